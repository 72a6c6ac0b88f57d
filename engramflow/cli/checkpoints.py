"""`engramflow make-checkpoint`, `inspect` and `lookup`."""
from __future__ import annotations

import json


def cmd_make_checkpoint(args) -> int:
    from engramflow.model.synth import make_checkpoint

    out = make_checkpoint(args.preset, args.out, args.engram_vocab_size, args.seed, progress=not args.quiet)
    print(json.dumps({"checkpoint": str(out), "preset": args.preset, "seed": args.seed}))
    return 0


def cmd_inspect(args) -> int:
    from engramflow.io.checkpoint import Checkpoint
    from engramflow.model.backbones import check_backbone_names

    from engramflow.cli.preflight import check_engine_files

    ckpt = Checkpoint(args.dir)  # config.json, index and every header checked
    check_engine_files(ckpt)  # the token map, checked as lookup and the pipeline load it
    doc = check_backbone_names(ckpt)  # V4.1: the full name set, headers only; a compact summary
    if doc is None:
        doc = ckpt.summary()
    if not args.headers_only:  # every byte of the Engram tables, scales and wkv (progress bar)
        doc["values"] = ckpt.verify_values()
    print(json.dumps(doc))
    return 0


def cmd_lookup(args) -> int:
    import torch

    from engramflow.errors import EngramflowError

    from engramflow.cli.prompts import read_prompt_ids
    from engramflow.memory.tables import EngramTable
    from engramflow.io.checkpoint import Checkpoint
    from engramflow.memory.history import SessionHistory

    ckpt = Checkpoint(args.dir)
    layer = ckpt.layout.layer_index(args.layer)
    table = EngramTable(ckpt, args.layer)
    history = SessionHistory.from_checkpoint(ckpt)
    addr = history.append(history.open(), read_prompt_ids(args))[:, layer]
    values = table.lookup(addr, torch.float32)
    bad = torch.isnan(values).view(addr.shape[0], addr.shape[1], -1).any(-1)  # [T, columns]
    if bool(bad.any()):
        t, c = (int(i) for i in bad.nonzero()[0])
        raise EngramflowError(f"layer {args.layer}: row {int(addr[t, c])} (position {t}, column {c}) decodes to "
                              "NaN: a broken checkpoint (engramflow inspect scans every row)")
    print(json.dumps({"addresses": addr.tolist(), "values": values.tolist()}))
    return 0


def register(sub) -> None:
    mk = sub.add_parser("make-checkpoint", help="write a synthetic checkpoint (official names and dtypes)")
    mk.add_argument("--preset", required=True, choices=["tiny", "v41-small", "v41-engram"],
                    help="v41-small: a whole V4.1 model at toy size; tiny: reference backbone; "
                         "v41-engram: real-size Engram tables and wkv only")
    mk.add_argument("--out", required=True, help="output directory")
    mk.add_argument("--engram-vocab-size", type=int, help="prime search start; sets the table rows (~24x this)")
    mk.add_argument("--seed", type=int, default=0, help="integer in [0, 2**32 - 1] (default 0)")
    mk.add_argument("--quiet", action="store_true", help="no progress bar")
    mk.set_defaults(func=cmd_make_checkpoint)

    ins = sub.add_parser("inspect", help="validate a checkpoint and print a JSON summary")
    ins.add_argument("dir", help="checkpoint folder (positional: engramflow inspect DIR)")
    ins.add_argument("--headers-only", action="store_true",
                     help="skip the scan of every Engram table byte for NaN encodings (minutes at full size)")
    ins.set_defaults(func=cmd_inspect)

    lk = sub.add_parser("lookup", help="print a prompt's decoded Engram rows for one layer (fp32 JSON)")
    lk.add_argument("dir", help="checkpoint folder (positional: engramflow lookup DIR ...)")
    lk.add_argument("--layer", type=int, required=True, help="Engram layer id (e.g. 1 or 14 in V4.1)")
    from engramflow.cli.prompts import add_prompt_args

    add_prompt_args(lk, text_file=False)
    lk.set_defaults(func=cmd_lookup)
