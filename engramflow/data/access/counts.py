"""Row counts: merging per-batch (row, count) pairs, coverage curves and hot-row lists.

Everything here is plain numpy on sorted int64 arrays; counts stay integers end to end.
"""
from __future__ import annotations

import numpy as np


def sum_by_row(rows: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Merge duplicate rows by summing their counts; returns (rows ascending, counts)."""
    rows = np.asarray(rows, dtype=np.int64)
    counts = np.asarray(counts, dtype=np.int64)
    if rows.size == 0:
        return rows, counts
    order = np.argsort(rows, kind="stable")
    rows, counts = rows[order], counts[order]
    starts = np.flatnonzero(np.r_[True, rows[1:] != rows[:-1]])
    return rows[starts], np.add.reduceat(counts, starts)


class CountMerger:
    """Accumulates (row, count) pieces per layer and folds them together now and then.

    Pieces are buffered and merged once the buffer outgrows the merged counts, so the memory
    stays about twice the number of distinct rows, and the sort cost stays amortized.
    """

    def __init__(self, n_layers: int, min_fold: int = 1 << 22):
        self.min_fold = min_fold
        self._merged = [(np.empty(0, np.int64), np.empty(0, np.int64)) for _ in range(n_layers)]
        self._pending: list[list[tuple[np.ndarray, np.ndarray]]] = [[] for _ in range(n_layers)]
        self._pending_size = [0] * n_layers

    def add(self, layer: int, rows: np.ndarray, counts: np.ndarray) -> None:
        self._pending[layer].append((rows, counts))
        self._pending_size[layer] += rows.size
        if self._pending_size[layer] >= max(self.min_fold, self._merged[layer][0].size):
            self._fold(layer)

    def _fold(self, layer: int) -> None:
        pieces = [self._merged[layer], *self._pending[layer]]
        self._merged[layer] = sum_by_row(np.concatenate([p[0] for p in pieces]),
                                         np.concatenate([p[1] for p in pieces]))
        self._pending[layer], self._pending_size[layer] = [], 0

    def result(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per layer: (rows ascending, counts)."""
        for layer in range(len(self._merged)):
            if self._pending[layer]:
                self._fold(layer)
        return list(self._merged)


def decades_up_to(n: int) -> list[int]:
    """1, 10, 100, ... up to the first power of ten >= n (n >= 1)."""
    ks = [1]
    while ks[-1] < n:
        ks.append(ks[-1] * 10)
    return ks


def coverage(counts: np.ndarray, ks=None) -> list[tuple[int, float]]:
    """(K, share of all accesses that the K most-accessed rows serve); K over decades by default.

    With the default K the curve ends at the first decade covering every row, i.e. at 1.0.
    """
    counts = np.sort(np.asarray(counts, dtype=np.int64))[::-1]
    if counts.size == 0:
        return []
    cum = np.cumsum(counts)
    ks = decades_up_to(counts.size) if ks is None else ks
    return [(int(k), float(cum[min(k, counts.size) - 1] / cum[-1])) for k in ks]


def hot_rows(rows: np.ndarray, counts: np.ndarray, k: int) -> np.ndarray:
    """int64 [min(k, rows), 2] of (row, count): count descending, ties by row ascending."""
    order = np.lexsort((rows, -counts))[:k]
    return np.stack([rows[order], counts[order]], axis=1).astype(np.int64)


def ngram_row_ranges(layout, layer: int) -> dict[int, tuple[int, int]]:
    """n-gram size -> the half-open row range its columns own in one layer's table.

    Columns are n-gram major, so the heads of one n-gram size own one contiguous range.
    """
    heads = layout.n_heads
    out = {}
    for n in range(2, layout.max_ngram + 1):
        first, last = (n - 2) * heads, (n - 1) * heads - 1
        out[n] = (int(layout.offsets[layer, first]), int(layout.offsets[layer, last] + layout.primes[layer, last]))
    return out


def split_by_ngram(layout, layer: int, rows: np.ndarray, counts: np.ndarray):
    """n-gram size -> (rows, counts) restricted to that size's row range (rows ascending)."""
    out = {}
    for n, (lo, hi) in ngram_row_ranges(layout, layer).items():
        a, b = np.searchsorted(rows, [lo, hi])
        out[n] = (rows[a:b], counts[a:b])
    return out
