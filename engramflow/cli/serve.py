"""`engramflow serve`: the OpenAI-compatible API on Ray Serve, each replica owning one pipeline.

Prints one JSON line with the URL once every replica is up (scripts wait for it), then serves
until SIGINT/SIGTERM. Binds 127.0.0.1 unless told otherwise.
"""
from __future__ import annotations

import json
import sys

from engramflow.errors import EngramflowError
from engramflow.cli.signals import serve_until, stop_requested

_LOOPBACK = ("127.0.0.1", "::1", "localhost")
APP = "engramflow"  # the Serve application's name


def _config(args):
    """The ServeConfig of the options, and every check that needs no Ray (the checkpoint's
    headers, the draft layers, the key file)."""
    from engramflow.cli.options import serve_config
    from engramflow.cli.preflight import check_checkpoint_headers
    from engramflow.pipeline.speculative import check_draft_tokens, draft_block_size
    from engramflow.tiers.protocol import check_count, read_secret_file

    check_count(args.port, "--port", 0, 65535)
    check_count(args.replicas, "--replicas", 1, 1024)
    key = None
    if args.api_key_file:  # serve-table's rules: a regular file, owner-only, 16 bytes to 4 KiB
        key = read_secret_file(args.api_key_file, private=True).decode("utf-8", "replace")
    cfg = serve_config(args, api_key=key)
    check_checkpoint_headers(args.checkpoint, args.backbone)  # what inspect --headers-only sees, before Ray
    spec = cfg.engine.spec
    if spec is not None:  # the draft layers and the draft count, before Ray
        check_draft_tokens(spec.k, draft_block_size(args.checkpoint))
    return cfg


def cmd_serve(args) -> int:
    cfg = _config(args)
    import ray
    from ray import serve

    from engramflow.pipeline.ray_address import ensure_ray
    from engramflow.serve.deployment import application
    from engramflow.serve.keeper import start_keeper

    if args.host not in _LOOPBACK:  # the API alone is widened: a local Ray stays on loopback
        print(f"engramflow serve: warning: the API listens on {args.host}, reachable beyond this machine"
              + ("" if cfg.api_key else " and without an API key")
              + ("; Ray's own ports are the cluster's (--address)" if args.address
                 else "; the local Ray instance and its metrics stay on 127.0.0.1"), file=sys.stderr)
    try:
        ensure_ray(args.address)
        keeper = start_keeper(APP)  # owns the replicas' pipelines: a killed replica's is adopted; held until exit
        serve.start(http_options={"host": args.host, "port": args.port}, logging_config={"log_level": "WARNING"})
        serve.run(application(cfg, args.replicas), name=APP, route_prefix="/")
    except EngramflowError:
        raise
    except Exception as e:  # a replica that failed to start: its error, in one line
        raise EngramflowError(f"the server did not start: {str(e).strip().splitlines()[-1] if str(e).strip() else e!r}") from None
    done = stop_requested()
    print(json.dumps({"listening": f"http://{args.host}:{args.port}", "model": args.model,
                      "replicas": args.replicas, "stages": args.stages}), flush=True)
    try:
        serve_until(done)
    finally:
        serve.shutdown()
        del keeper  # the pipelines' owner goes last: the replicas have released theirs
        ray.shutdown()
    return 0


def register(sub) -> None:
    p = sub.add_parser("serve", help="serve the OpenAI API (chat + completions) on Ray Serve")
    p.add_argument("--checkpoint", required=True, help="checkpoint folder")
    p.add_argument("--stages", type=int, default=1, help="pipeline stages per replica (default 1)")
    p.add_argument("--projection", choices=("host", "stage", "auto"), default="host",
                   help="where Engram layers are projected (default host)")
    p.add_argument("--backbone", help="backbone kind (default: the checkpoint's)")
    p.add_argument("--block-ms", type=float, default=1.0, help="emulated backbone: ms per block")
    p.add_argument("--prefill-chunk", type=int, default=512, help="prefill chunk in tokens (default 512)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--replicas", type=int, default=1, help="replicas, each with its own pipeline (default 1)")
    p.add_argument("--max-sessions", type=int, default=64, help="requests decoded at once per replica (default 64)")
    p.add_argument("--allow-remote-images", action="store_true",
                   help="let chat image_url parts name http(s) URLs, fetched by the server (default: data: URLs only)")
    p.add_argument("--max-n", type=int, default=16,
                   help="the most choices (n) one request may ask for; each is a session (default 16)")
    p.add_argument("--max-queue", type=int, default=256,
                   help="requests waiting per replica before a 429 (default 256)")
    p.add_argument("--max-restarts", type=int, default=10,
                   help="stage actors re-made per replica before its pipeline gives up and Serve replaces "
                        "the replica (default 10)")
    from engramflow.serve.limits import Limits

    p.add_argument("--max-body-bytes", type=int, default=Limits.max_body_bytes,
                   help=f"largest request body; past it a 413 (default {Limits.max_body_bytes})")
    p.add_argument("--max-images", type=int, default=Limits.max_images,
                   help=f"image parts per chat request (default {Limits.max_images})")
    p.add_argument("--max-image-pixels", type=int, default=Limits.max_image_pixels,
                   help=f"pixels per image, from its header before decoding (default {Limits.max_image_pixels})")
    p.add_argument("--api-key-file", help="file holding the API key (mode 600 or stricter, 16 bytes to 4 KiB)")
    p.add_argument("--model", default="engramflow", help="the model name clients send (default engramflow)")
    p.add_argument("--address", help="Ray cluster address (default: start a local Ray)")
    p.add_argument("--in-process", action="store_true", help="run the model in the replica (Engine), no stage actors")
    p.add_argument("--speculative", default=None, metavar="dspark[:K][:exact][:adaptive[=P]]",
                   help="speculative decoding with the model's DSpark draft layers (default off); see generate")
    p.add_argument("--prefix-cache-mb", type=float, default=None, metavar="MiB",
                   help="memory per replica for finished sessions kept so that a later request sharing their "
                        "prefix (a chat's history, a system prompt) prefills only the rest; 0 turns it off "
                        "(default: 8 full contexts, at most 1 GiB of any stage's memory)")
    p.set_defaults(func=cmd_serve)
