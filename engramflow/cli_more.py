"""Subcommands beyond addressing; grows with the pipeline."""
from __future__ import annotations

import json


def cmd_demo(args) -> int:
    from engramflow.memory.history import SessionHistory
    from engramflow.memory.token_map import load_tokenizer
    from engramflow.model.config import preset

    cfg = preset("deepseek-v4.1-flash")
    history = SessionHistory.from_config(cfg)
    text = "DeepSeek Engram reads its memory ahead of the backbone."
    enc = load_tokenizer().encode(text)
    addr = history.append(history.open(), enc.ids)
    print(f"Engram addresses for {text!r} ({len(enc.ids)} tokens, layers {list(cfg.engram_layer_ids)}):")
    for pos, (tok, row) in enumerate(zip(enc.tokens, addr)):
        print(f"  {pos:3d} {tok!r:>14}  L{cfg.engram_layer_ids[0]}: {json.dumps(row[0][:4].tolist())[:-1]}, ...]")
    return 0


def register(sub) -> None:
    demo = sub.add_parser("demo", help="run the demo on a built-in default")
    demo.set_defaults(func=cmd_demo)
