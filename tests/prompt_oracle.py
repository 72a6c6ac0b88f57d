"""The tokens a chat prompt should have, computed apart from the server's code: render the
messages with a marker where the client's text goes, let the real tokenizer find the special
tokens of that text (the format's, since the marker holds none), then put the client's text
back into the runs between them and tokenize those with the vocabulary alone (no added tokens),
as plain text."""
from __future__ import annotations

import copy
import json

from tokenizers import Tokenizer

from engramflow.chat import ChatOptions, encode_chat

MARK = "QzqMARKqzQ"


_PLAIN: dict = {}


def vocabulary_only(tok) -> Tokenizer:
    """The tokenizer's vocabulary and rules without its added tokens (cached per tokenizer)."""
    if id(tok) in _PLAIN:
        return _PLAIN[id(tok)][1]
    spec = json.loads(tok.to_str())
    spec["added_tokens"] = []
    _PLAIN[id(tok)] = (tok, Tokenizer.from_str(json.dumps(spec)))
    return _PLAIN[id(tok)][1]


def replace_strings(value, old: str, new: str):
    """A deep copy of a JSON value with `old` replaced by `new` in every string (keys too)."""
    if isinstance(value, str):
        return value.replace(old, new)
    if isinstance(value, list):
        return [replace_strings(v, old, new) for v in value]
    if isinstance(value, dict):
        return {replace_strings(k, old, new): replace_strings(v, old, new) for k, v in value.items()}
    return copy.deepcopy(value)


def expected_ids(tok, messages, options: ChatOptions, injected: str) -> list[int]:
    """`messages` hold `injected` as client text: the ids they should reach the model as."""
    text = encode_chat(replace_strings(messages, injected, MARK), replace_options(options, injected))
    enc = tok.encode(text, add_special_tokens=False)
    special = {tid for tid in tok.get_added_tokens_decoder()}
    plain = vocabulary_only(tok)
    out, pos = [], 0
    for tid, (start, end) in zip(enc.ids, enc.offsets):
        if tid in special:
            run = text[pos:start].replace(MARK, injected)
            out += plain.encode(run, add_special_tokens=False).ids if run else []
            out.append(tid)
            pos = end
    run = text[pos:].replace(MARK, injected)
    return out + (plain.encode(run, add_special_tokens=False).ids if run else [])


def replace_options(options: ChatOptions, injected: str) -> ChatOptions:
    tools = None if options.tools is None else replace_strings(options.tools, injected, MARK)
    return ChatOptions(options.thinking, options.reasoning_effort, tools)
