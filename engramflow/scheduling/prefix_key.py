"""A prompt's prefix-cache key: one int64 per position of the session it writes.

A text position's value is its token id (>= 0). An image placeholder becomes its image's whole
span (as the runner expands it, pipeline/image_inputs.py), every position of it carrying one
negative value derived from a hash of the prepared image's pixels and its grid: the same image
at the same place matches, any other image (or the placeholder written as text) does not, so a
hit never reuses another image's rows. A prefix that ends inside a span is cut back to the
span's start (the image is encoded again as a whole).
"""
from __future__ import annotations

import dataclasses
import hashlib

import numpy as np
import torch

_IMAGE_BASE = 1 << 32  # image values are below -2**32: never a token id, never another kind


def image_value(img) -> int:
    """A PreparedImage -> the key value of each of its span's positions."""
    h = hashlib.blake2b(digest_size=8)
    h.update(repr((tuple(img.patches.shape), img.span_tokens)).encode())
    h.update(img.patches.detach().contiguous().view(torch.int16).cpu().numpy().tobytes())
    return -(_IMAGE_BASE + (int.from_bytes(h.digest(), "little") >> 2))


@dataclasses.dataclass
class PromptKey:
    key: np.ndarray  # int64, one per position of the expanded prompt
    spans: list[tuple[int, int, int]]  # (start in the expanded prompt, span length, placeholder index in prompt_ids)

    def cut(self, n: int) -> int:
        """`n` shared positions, moved back to the start of an image span it would split."""
        for start, length, _ in self.spans:
            if start < n < start + length:
                return start
        return n

    def split(self, n: int) -> tuple[int, int]:
        """(index in prompt_ids, images before) where the expanded prompt's position n (not inside a span) is."""
        before = [s for s in self.spans if s[0] < n]
        return n - sum(length - 1 for _, length, _ in before), len(before)


def prompt_key(ids, prepared: list, image_token_id: int | None) -> PromptKey:
    """The key of a prompt (`ids` with one placeholder per image) and its prepared images."""
    ids = np.asarray(ids, dtype=np.int64)
    if not prepared:
        return PromptKey(ids.copy(), [])
    where = np.flatnonzero(ids == image_token_id)
    parts, spans, prev, length = [], [], 0, 0
    for pos, img in zip(where, prepared):  # the runner checks the counts agree; a mismatch fails there
        parts.append(ids[prev:pos])
        length += pos - prev
        spans.append((length, img.span_tokens, int(pos)))
        parts.append(np.full(img.span_tokens, image_value(img), dtype=np.int64))
        length += img.span_tokens
        prev = pos + 1
    parts.append(ids[prev:])
    return PromptKey(np.concatenate(parts), spans)
