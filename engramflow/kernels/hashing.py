"""N-gram hashing: compressed-id windows -> Engram row addresses (DESIGN §2), vectorized.

A window holds the `n_ctx` history entries just before the new positions (at most
max_ngram − 1 of them; fewer only when the session is that short) followed by the new
positions. Look-backs past the window's start are therefore past the session's start.
"""
from __future__ import annotations

import numpy as np

from engramflow.memory.layout import EngramLayout

DEAD = -1  # a position that takes no part in n-grams (image spans)


def hash_window(window: np.ndarray, n_ctx: int, layout: EngramLayout, pad: int) -> np.ndarray:
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


def hash_reference(hist: list[int], layout: EngramLayout, pad: int) -> list[list[list[int]]]:
    """The DESIGN §2 rule written per position with Python ints: the scalar oracle."""

    def wrap64(v: int) -> int:
        v &= (1 << 64) - 1
        return v - (1 << 64) if v >= 1 << 63 else v

    hist = [int(v) for v in hist]
    out = []
    for p in range(len(hist)):
        blocked, toks = False, []
        for s in range(layout.max_ngram):
            src = hist[p - s] if p >= s else DEAD
            blocked = blocked or p < s or src == DEAD
            toks.append(pad if blocked else src)
        per_layer = []
        for li in range(len(layout.layer_ids)):
            mult = [int(m) for m in layout.multipliers[li]]
            rolling = wrap64(toks[0] * mult[0])
            row = []
            for i in range(1, layout.max_ngram):
                rolling = wrap64(rolling ^ wrap64(toks[i] * mult[i]))
                for h in range(layout.n_heads):
                    c = (i - 1) * layout.n_heads + h
                    row.append(rolling % int(layout.primes[li, c]) + int(layout.offsets[li, c]))
            per_layer.append(row)
        out.append(per_layer)
    return out
