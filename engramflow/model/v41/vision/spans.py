"""An image's span in the token stream, and the rows that replace its embeddings.

    START, (IMAGE x llm_w, NEW_LINE) x llm_h, END

Every span position carries `image_token_id` as its token id; Engram sees it as DEAD (no n-gram
crosses an image) and the MoE routes it with `bias_vl`. Its embedding row is overwritten: the
delimiters with their learned vectors, the IMAGE slots with the aligner rows in reading order.
"""
from __future__ import annotations

import dataclasses

import torch

TEXT, START, IMAGE, NEW_LINE, END = -1, 0, 1, 2, 3


def span_types(llm_h: int, llm_w: int) -> list[int]:
    return [START] + ([IMAGE] * llm_w + [NEW_LINE]) * llm_h + [END]


def span_rows(features: torch.Tensor, llm_h: int, llm_w: int, delimiters: dict[str, torch.Tensor]) -> torch.Tensor:
    """aligner rows [llm_h*llm_w, dim] -> the span's rows [llm_h*(llm_w+1)+2, dim] bf16."""
    dim = features.shape[-1]
    grid = features.to(torch.bfloat16).view(llm_h, llm_w, dim)
    newline = delimiters["image_newline"].to(torch.bfloat16).view(1, 1, dim).expand(llm_h, 1, dim)
    body = torch.cat([grid, newline], dim=1).reshape(-1, dim)
    return torch.cat([delimiters["image_start"].view(1, dim).to(torch.bfloat16), body,
                      delimiters["image_end"].view(1, dim).to(torch.bfloat16)])


@dataclasses.dataclass(frozen=True)
class ImageSlot:
    """Span rows to write over positions [start, start + n) of a request (relative to its first
    position). `rows` holds the whole span (a tensor, or a reference a backend resolves); `skip`
    says where this piece begins inside it, so a span cut by chunking or rollback stays exact.
    `source` (driver side only) is the PreparedImage, kept so a backend can encode it again."""
    start: int
    n: int
    rows: object
    skip: int = 0
    source: object = dataclasses.field(default=None, compare=False, repr=False)

    def clip(self, a: int, b: int) -> "ImageSlot | None":
        """The part inside [a, b), re-based to a; None when nothing is."""
        lo, hi = max(a, self.start), min(b, self.start + self.n)
        if lo >= hi:
            return None
        return ImageSlot(lo - a, hi - lo, self.rows, self.skip + lo - self.start, self.source)


def clip_slots(slots, a: int, b: int) -> tuple[ImageSlot, ...]:
    return tuple(s for s in (slot.clip(a, b) for slot in slots or ()) if s is not None)
