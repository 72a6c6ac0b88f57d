"""A chat prompt as pieces that say who wrote them: the format (the encoder's own text, whose
special tokens are the conversation's structure), a client's text (tokenized as plain text:
`<｜User｜>` written in a message is ordinary characters, never a turn), or an image slot.

Joined, the pieces are exactly the prompt text the official encoder writes; tokenizing them
piece-aware only changes prompts whose client text spells a special token.
"""
from __future__ import annotations

import dataclasses

from engramflow.chat import tokens as T
from engramflow.chat.messages import ChatError

FORMAT, TEXT, IMAGE = "format", "text", "image"


@dataclasses.dataclass(frozen=True)
class Piece:
    text: str
    kind: str = FORMAT
    where: str = ""  # TEXT pieces: the request field it came from (for errors)


class Pieces:
    """An append-only list of pieces (empty texts are dropped: they tokenize to nothing)."""

    def __init__(self):
        self.items: list[Piece] = []

    def fmt(self, text: str) -> "Pieces":
        if text:
            self.items.append(Piece(text, FORMAT))
        return self

    def text(self, text: str, where: str) -> "Pieces":
        # the image placeholder comes only from image parts; DeepSeek's encoder refuses it in text
        if T.IMAGE in text:
            raise ChatError(f"{where} contains the image placeholder {T.IMAGE!r}: images are sent as "
                            f"image_url parts, not written in text", where)
        if text:
            self.items.append(Piece(text, TEXT, where))
        return self

    def image(self) -> "Pieces":
        self.items.append(Piece(T.IMAGE, IMAGE))
        return self

    def extend(self, other: "Pieces") -> "Pieces":
        self.items += other.items
        return self


def joined(pieces: list[Piece]) -> str:
    return "".join(p.text for p in pieces)
