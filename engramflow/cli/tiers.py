"""`engramflow serve-table`: hold one Engram table in RAM and serve it to remote-RAM tiers.

Prints one JSON line with the bound address once it is listening (scripts wait for it), then
serves until SIGINT/SIGTERM. Run it as `engramflow serve-table ...` (or `python -m engramflow.cli serve-table ...`).
"""
from __future__ import annotations

import json
import sys

from engramflow.errors import EngramflowError
from engramflow.cli.signals import serve_until, stop_requested

_LOOPBACK = ("127.0.0.1", "::1", "localhost")


def cmd_serve_table(args) -> int:
    from engramflow.io.checkpoint import Checkpoint
    from engramflow.tiers.protocol import MAX_TIMEOUT, check_count, check_seconds, read_secret_file
    from engramflow.tiers.server import MAX_CLIENTS, MAX_ROWS, TableServer

    # every number finite and bounded (inf/nan would be accepted by argparse and then fail on
    # every connection); checked before anything is read
    check_count(args.port, "--port", 0, 65535)
    check_count(args.max_rows, "--max-rows", 1, MAX_ROWS)
    check_count(args.max_clients, "--max-clients", 1, MAX_CLIENTS)
    check_count(args.max_handshakes, "--max-handshakes", 1, MAX_CLIENTS)
    check_seconds(args.idle_timeout, "--idle-timeout", hi=MAX_TIMEOUT)
    check_seconds(args.request_timeout, "--request-timeout", hi=MAX_TIMEOUT)
    check_seconds(args.handshake_timeout, "--handshake-timeout", hi=60.0)
    # a regular file, at most a few KiB, readable by its owner only (like an ssh key); before the slow table load
    secret = read_secret_file(args.secret_file, private=True)
    ckpt = Checkpoint(args.checkpoint)
    if args.layer not in ckpt.config.engram_layer_ids:
        raise EngramflowError(f"--layer {args.layer} is not an Engram layer of {args.checkpoint} "
                              f"(have {list(ckpt.config.engram_layer_ids)})")
    if args.host not in _LOOPBACK:
        print(f"engramflow serve-table: warning: listening on {args.host}, reachable beyond this machine; "
              "the shared secret is the only protection and rows travel unencrypted", file=sys.stderr)
    server = TableServer.from_checkpoint(
        ckpt, args.layer, secret, copy=not args.mmap, host=args.host, port=args.port, max_rows=args.max_rows,
        idle_timeout=args.idle_timeout, request_timeout=args.request_timeout, max_clients=args.max_clients,
        max_handshakes=args.max_handshakes, handshake_timeout=args.handshake_timeout)
    done = stop_requested()
    server.start()
    host, port = server.address
    print(json.dumps({"listening": f"{host}:{port}", "host": host, "port": port, "layer": args.layer,
                      "rows": server.rows, "head_dim": server.head_dim}), flush=True)
    try:
        serve_until(done)
    finally:
        server.stop()
    print(json.dumps({"stopped": True, "stats": server.stats}), flush=True)
    return 0


def register(sub) -> None:
    p = sub.add_parser("serve-table", help="serve one Engram table from RAM to remote-RAM tiers")
    p.add_argument("--checkpoint", required=True, help="checkpoint directory")
    p.add_argument("--layer", type=int, required=True, help="Engram layer id whose table to serve")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback only)")
    p.add_argument("--port", type=int, default=7411, help="TCP port (0: any free port; default 7411)")
    p.add_argument("--secret-file", required=True,
                   help="regular file holding the shared secret (16 bytes to 4 KiB), mode 600 or stricter")
    p.add_argument("--max-rows", type=int, default=1 << 16, help="row ids per request at most (<= 2^20)")
    p.add_argument("--idle-timeout", type=float, default=60.0, help="seconds a connection may sit idle (<= 86400)")
    p.add_argument("--request-timeout", type=float, default=5.0,
                   help="seconds to finish a started request (<= 86400)")
    p.add_argument("--max-clients", type=int, default=64, help="authenticated connections at most (<= 4096)")
    p.add_argument("--max-handshakes", type=int, default=64,
                   help="unauthenticated connections at most; when full the oldest is dropped (<= 4096)")
    p.add_argument("--handshake-timeout", type=float, default=2.0,
                   help="seconds a new connection has to authenticate (<= 60)")
    p.add_argument("--mmap", action="store_true",
                   help="serve from the warmed checkpoint mapping, not a RAM copy (a file rewritten in place "
                        "then gives clients errors)")
    p.set_defaults(func=cmd_serve_table)

