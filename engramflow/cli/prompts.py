"""Prompt arguments shared by subcommands: --text / --text-file / --ids."""
from __future__ import annotations

import argparse
from pathlib import Path

from engramflow.errors import EngramflowError


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
    from engramflow.io.token_map import load_tokenizer

    return load_tokenizer(getattr(args, "tokenizer", None)).encode(text).ids


def add_prompt_args(p: argparse.ArgumentParser, text_file: bool = True) -> None:
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--text", help="prompt text (tokenized with the V4 tokenizer)")
    if text_file:
        g.add_argument("--text-file", help="file holding the prompt text")
    g.add_argument("--ids", help="comma-separated token ids, e.g. 1,2,3")
