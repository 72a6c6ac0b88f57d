"""N-gram hashing: compressed-id windows -> Engram row addresses (docs/v41.md, "Engram"), vectorized.

A window holds the `n_ctx` history entries just before the new positions (at most
max_ngram − 1 of them; fewer only when the session is that short) followed by the new
positions. Look-backs past the window's start are therefore past the session's start.
"""
from __future__ import annotations

from typing import Protocol

import numpy as np

DEAD = -1  # a position that takes no part in n-grams (image spans)


class HashTables(Protocol):
    """What hashing reads from a layout (io.layout.EngramLayout has it): plain arrays, so this
    kernel depends on nothing above it."""
    layer_ids: tuple[int, ...]
    max_ngram: int
    n_heads: int
    multipliers: np.ndarray  # int64 [layers, max_ngram]
    primes: np.ndarray       # int64 [layers, columns]
    offsets: np.ndarray      # int64 [layers, columns]


def hash_window(window: np.ndarray, n_ctx: int, layout: HashTables, pad: int) -> np.ndarray:
    """Row addresses for window[n_ctx:], as int64 [T, n_layers, columns]."""
    window = np.asarray(window, dtype=np.int64)
    n_new = window.shape[0] - n_ctx
    # look-back index of shift s for new position t: column s of [T, N]
    back = np.arange(n_ctx, n_ctx + n_new)[:, None] - np.arange(layout.max_ngram)[None, :]
    src = window[np.maximum(back, 0)]
    # once a look-back hits the start or a DEAD entry, every farther one is blocked too
    blocked = np.logical_or.accumulate((back < 0) | (src == DEAD), axis=1)
    shifted = np.where(blocked, pad, src)
    # [T, 1, N] * [L, N] wraps in int64 exactly like the reference implementation
    prod = shifted[:, None, :] * layout.multipliers[None, :, :]
    rolling = np.bitwise_xor.accumulate(prod, axis=2)[:, :, 1:]  # [T, L, N-1]: 2-gram .. N-gram
    rolling = np.repeat(rolling, layout.n_heads, axis=2)  # one column per (n-gram, head)
    # np.remainder is floor-mod (non-negative for a positive prime), as in the reference
    return np.remainder(rolling, layout.primes[None]) + layout.offsets[None]

