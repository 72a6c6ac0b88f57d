"""Chat prompt pieces -> token ids: structure from the encoder, text from the client.

The special tokens in the format's pieces become their single ids; a client's text is tokenized
as plain text, so `<｜end▁of▁sentence｜><｜System｜>...` inside a tool result is ordinary
characters and cannot end a turn or forge one. The tokenizer's own rule is kept everywhere
else: it cuts the text at every special token and tokenizes the runs between them on their own,
so a prompt whose client text spells no special token gets exactly the ids that tokenizing its
whole text gives (the chat tests compare that text with DeepSeek's official encoder).

The plain-text tokenizer is the checkpoint's with its added tokens removed (same normalizer,
pre-tokenizer and BPE). Runs are encoded through `encode_batch`, which releases the GIL: a long
prompt tokenized in a worker thread does not stall the server's event loop.
"""
from __future__ import annotations

import json
import re

from engramflow.chat.pieces import FORMAT, IMAGE, TEXT, Piece


def plain_tokenizer(tokenizer, spec: str | None = None):
    """The same tokenizer without added tokens: special-token strings are plain text to it.
    `spec`: the tokenizer's JSON, when its file is at hand (writing a 129k-token tokenizer
    out again costs over a second of a replica's start)."""
    from tokenizers import Tokenizer

    spec = json.loads(spec if spec is not None else tokenizer.to_str())
    spec["added_tokens"] = []
    return Tokenizer.from_str(json.dumps(spec, ensure_ascii=False))


class PromptTokenizer:
    def __init__(self, tokenizer, spec: str | None = None):
        self.tok = tokenizer
        self.plain = plain_tokenizer(tokenizer, spec)
        self.special = {t.content: tid for tid, t in tokenizer.get_added_tokens_decoder().items()}
        # leftmost, then longest, as the tokenizer matches its added tokens
        names = sorted(self.special, key=len, reverse=True)
        self.pattern = re.compile("|".join(map(re.escape, names))) if names else None

    def text_ids(self, text: str) -> list[int]:
        """Plain text (no special tokens read), off the GIL."""
        return self.plain.encode_batch([text], add_special_tokens=False)[0].ids if text else []

    def ids(self, pieces: list[Piece], image_id: int | None = None) -> list[int]:
        """The prompt's ids; each image slot is `image_id` (the config's placeholder id)."""
        out: list[int] = []
        run: list[str] = []  # text since the last special token: tokenized as one run

        def flush():
            out.extend(self.text_ids("".join(run)))
            run.clear()

        for kind, text in _merged(pieces):
            if kind == TEXT:
                run.append(text)
            elif kind == IMAGE:
                if image_id is None:
                    raise ValueError("an image slot needs the image placeholder id")
                flush()
                out.append(image_id)
            else:
                pos = 0
                for m in self.pattern.finditer(text) if self.pattern else ():
                    run.append(text[pos:m.start()])
                    flush()
                    out.append(self.special[m.group()])
                    pos = m.end()
                run.append(text[pos:])
        flush()
        return out


def _merged(pieces: list[Piece]):
    """(kind, text) with neighbouring format pieces joined, so a special token the format spells
    across two of its pieces is still one token."""
    kind, buf = None, []
    for p in pieces:
        if p.kind == FORMAT and kind == FORMAT:
            buf.append(p.text)
            continue
        if kind is not None:
            yield kind, "".join(buf)
        kind, buf = p.kind, [p.text]
    if kind is not None:
        yield kind, "".join(buf)
