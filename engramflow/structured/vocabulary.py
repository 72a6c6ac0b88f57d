"""The checkpoint's tokenizer as xgrammar sees it: every token id -> the bytes it writes.

A grammar is matched on bytes, so each token is handed over as its raw bytes (xgrammar's RAW
vocabulary): byte-level BPE pieces are mapped back through the GPT-2 byte table, added tokens
are their UTF-8 text. Added tokens are control tokens (BOS, <think>, </think>, the role tags,
image slots ...), so they are handed over as empty (xgrammar then treats them as special and
never allows one inside a grammar) -- except `｜DSML｜`, which is the text of the tool-call
markup and must stay writable, and EOS, the one stop token: a finished grammar allows only EOS.
The mask covers the model's vocab_size (the logits' width), which may exceed the tokenizer's.
"""
from __future__ import annotations

from engramflow.chat import tokens as T


def _byte_table() -> dict[str, int]:
    """The byte-level alphabet: each byte is one printable character (GPT-2's table)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, shifted = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:  # the unprintable bytes take the characters from U+0100 on, in order
            chars[chr(256 + shifted)] = b
            shifted += 1
    return chars


BYTE_OF = _byte_table()
TEXT_ADDED_TOKENS = frozenset({T.DSML})  # added tokens that are plain text of the chat format


def token_bytes(tokenizer, vocab_size: int) -> list[bytes]:
    """Bytes written by each id in [0, vocab_size) (b"" for control tokens and unused ids)."""
    out = [b""] * vocab_size
    added = {i: t.content for i, t in tokenizer.get_added_tokens_decoder().items()}
    for piece, i in tokenizer.get_vocab(with_added_tokens=False).items():
        if i < vocab_size and i not in added:
            out[i] = bytes(BYTE_OF[c] for c in piece)
    for i, text in added.items():
        if i < vocab_size and text in TEXT_ADDED_TOKENS:
            out[i] = text.encode("utf-8")
    return out


def tokenizer_info(tokenizer, vocab_size: int):
    import xgrammar as xgr

    eos = tokenizer.token_to_id(T.EOS)
    if eos is None:
        raise ValueError(f"the tokenizer has no {T.EOS} token: a grammar could never end")
    return xgr.TokenizerInfo(token_bytes(tokenizer, vocab_size), xgr.VocabType.RAW, vocab_size=vocab_size,
                             stop_token_ids=[eos])
