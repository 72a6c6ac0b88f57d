"""Prompt arguments shared by subcommands: --text / --text-file / --ids."""
from __future__ import annotations

import argparse
from pathlib import Path

from engramflow.errors import EngramflowError


def check_text(text: str, what: str = "the prompt text") -> str:
    """`text` if it encodes as UTF-8. A lone surrogate (e.g. from an argument that was not valid
    UTF-8, which Python decodes with surrogateescape) cannot be tokenized: name it, refuse it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise EngramflowError(f"{what} is not valid UTF-8: lone surrogate U+{ord(text[e.start]):04X} "
                              f"at character {e.start}") from None
    return text


def text_arg(text: str) -> str:
    """argparse type for free text (--text, --prompt): refused at parse time, exit 2."""
    try:
        return check_text(text, "the text")
    except EngramflowError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


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

    return load_tokenizer(getattr(args, "tokenizer", None)).encode(check_text(text)).ids


def add_prompt_args(p: argparse.ArgumentParser, text_file: bool = True) -> None:
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--text", type=text_arg, help="prompt text (tokenized with the V4 tokenizer)")
    if text_file:
        g.add_argument("--text-file", help="file holding the prompt text")
    g.add_argument("--ids", help="comma-separated token ids, e.g. 1,2,3")
