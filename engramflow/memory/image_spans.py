"""Image spans: half-open token-position ranges whose tokens are DEAD for Engram."""
from __future__ import annotations

import numpy as np

from engramflow.errors import EngramflowError


def parse_spans(text: str) -> list[tuple[int, int]]:
    """Parse "START:END,START:END" (half-open ranges)."""
    spans = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        bits = part.split(":")
        try:
            if len(bits) != 2:
                raise ValueError
            spans.append((int(bits[0]), int(bits[1])))
        except ValueError:
            raise EngramflowError(f"image span {part!r} is not START:END with integers") from None
    return spans


def spans_to_mask(spans, n_tokens: int) -> np.ndarray:
    """A bool DEAD mask of length n_tokens; spans must lie inside it and not overlap."""
    mask = np.zeros(n_tokens, dtype=bool)
    for span in spans:
        try:
            start, end = (int(v) for v in span)
        except (TypeError, ValueError):
            raise EngramflowError(f"image span {span!r} is not a (start, end) pair of integers") from None
        if not 0 <= start < end <= n_tokens:
            raise EngramflowError(f"image span {start}:{end} is empty or outside the prompt's {n_tokens} tokens")
        if mask[start:end].any():
            raise EngramflowError(f"image span {start}:{end} overlaps another span")
        mask[start:end] = True
    return mask
