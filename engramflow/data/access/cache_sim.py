"""Cache hit rates of an ordered stream of row ids: an LRU of N rows and a static hot set.

* LRU: exact, for every N at once, from stack (reuse) distances: an access hits an LRU of N
  rows iff fewer than N distinct rows were touched since the previous access to its row. The
  distances come from an offline count, vectorized with numpy: for access i with previous
  access p, d_i = #{j in (p, i) : next_j > i} (the j that are the last access to their row
  before i), counted over the O(log n) aligned blocks of a segment tree whose blocks hold their
  `next` values sorted (one searchsorted per level for all queries).
* Static hot set: the rows ranked by their count in the first half of the stream (ties: lower
  row first, as access-stats' hot-row lists); an access of the second half hits the set of N
  iff its row ranks below N.

Both curves are measured on the second half of the stream, the LRU warmed by the first half,
so they compare on the same accesses; `lru_whole` is the LRU over the whole stream from cold.
"""
from __future__ import annotations

import numpy as np

NO_PREVIOUS = np.iinfo(np.int64).max  # the stack distance of a first access: a miss at every size


def previous_and_next(stream: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """prev[i] (index of the previous access to the same row, -1 if none) and next[i] (the next
    one, len(stream) if none)."""
    n = stream.size
    order = np.argsort(stream, kind="stable")
    s = stream[order]
    same = s[1:] == s[:-1]
    prev = np.full(n, -1, np.int64)
    nxt = np.full(n, n, np.int64)
    prev[order[1:][same]] = order[:-1][same]
    nxt[order[:-1][same]] = order[1:][same]
    return prev, nxt


def stack_distances(stream) -> np.ndarray:
    """Per access, the number of distinct rows touched since the previous access to its row
    (NO_PREVIOUS for a first access)."""
    stream = np.asarray(stream, np.int64).reshape(-1)
    n = stream.size
    prev, nxt = previous_and_next(stream)
    out = np.full(n, NO_PREVIOUS, np.int64)
    q = np.flatnonzero(prev >= 0)
    if not q.size:
        return out
    levels = max(1, int(np.ceil(np.log2(n))))
    size = 1 << levels
    vals = np.full(size, -1, np.int64)  # padding never counts (-1 is never > i)
    vals[:n] = nxt
    lo, hi = prev[q] + 1, q.copy()  # the open interval (p, i) as [lo, hi)
    thr = q  # count next_j > i
    count = np.zeros(q.size, np.int64)
    big = np.int64(n + 2)
    for level in range(levels + 1):
        width = 1 << level
        blocks = size >> level
        live = lo < hi
        if not live.any():
            break
        # each block's next values sorted, shifted by block * big so one global searchsorted serves all
        flat = (np.sort(vals.reshape(blocks, width), axis=1) + np.arange(blocks, dtype=np.int64)[:, None] * big).reshape(-1)
        for take, node in (((lo & 1) == 1) & live, lo), (((hi & 1) == 1) & live, hi - 1):
            if take.any():
                b = node[take]
                pos = np.searchsorted(flat, b * big + thr[take], side="right")
                count[take] += (b + 1) * width - pos
        lo = np.where(((lo & 1) == 1) & live, lo + 1, lo) >> 1
        hi = np.where(((hi & 1) == 1) & live, hi - 1, hi) >> 1
    out[q] = count
    return out


def lru_hit_rates(distances: np.ndarray, sizes) -> list[float]:
    """Hit rate of an LRU of N rows, per N, from the accesses' stack distances."""
    if not distances.size:
        return [0.0 for _ in sizes]
    d = np.sort(distances)
    return [float(np.searchsorted(d, int(n), side="left") / d.size) for n in sizes]


def static_hit_rates(train: np.ndarray, test: np.ndarray, sizes) -> list[float]:
    """Hit rate on `test` of the top-N rows of `train` by count (ties: lower row first), per N."""
    if not test.size:
        return [0.0 for _ in sizes]
    rows, counts = np.unique(train, return_counts=True)
    ranked = rows[np.lexsort((rows, -counts))]
    rank_of_sorted = np.empty(rows.size, np.int64)
    rank_of_sorted[np.searchsorted(rows, ranked)] = np.arange(rows.size)
    pos = np.searchsorted(rows, test)
    known = (pos < rows.size) & (rows[np.minimum(pos, rows.size - 1)] == test)
    rank = np.where(known, rank_of_sorted[np.minimum(pos, rows.size - 1)], NO_PREVIOUS)
    r = np.sort(rank)
    return [float(np.searchsorted(r, int(n), side="left") / r.size) for n in sizes]


def sizes_up_to(n: int) -> list[int]:
    """Cache sizes 1, 2, 5, 10, 20, 50, ... up to and including the first one >= n."""
    out, e = [], 0
    while True:
        for m in (1, 2, 5):
            out.append(m * 10**e)
            if out[-1] >= n:
                return out
        e += 1


def hit_rate_curves(stream, sizes=None) -> dict:
    """{"sizes", "lru", "static", "lru_whole", "accesses", "test_accesses", "distinct_rows"} for one stream."""
    stream = np.asarray(stream, np.int64).reshape(-1)
    half = stream.size // 2
    distinct = int(np.unique(stream).size)
    sizes = list(sizes) if sizes is not None else sizes_up_to(max(distinct, 1))
    d = stack_distances(stream)
    return {"sizes": sizes, "lru": lru_hit_rates(d[half:], sizes),
            "static": static_hit_rates(stream[:half], stream[half:], sizes),
            "lru_whole": lru_hit_rates(d, sizes), "accesses": int(stream.size),
            "test_accesses": int(stream.size - half), "distinct_rows": distinct}
