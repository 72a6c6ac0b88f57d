"""Prefill pipelining: the next chunk's rows are read while the caller projects this chunk.

A long prompt's lookups through an I/O-bound store (the SSD tier) are an IOPS budget; the
projection of the rows is a GEMM. `pipelined_lookup` splits the tokens into chunks and keeps
one chunk's lookup (its reads, submitted at queue depth, and the decode) in flight on a
background thread while the caller consumes the chunk before it, so I/O and compute overlap.
Each chunk's rows are exactly `store.lookup` of that chunk (lookups are row-independent).
"""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

# 1024 x 24 rows per layer: ~25K reads per batch, plenty to keep a device's queue full. Not
# smaller: each projection call dequantizes the whole wkv once, so on a CPU projection 4 calls of
# 128 tokens measured 2-3x one call of 512; chunks must stay large for the overlap to pay.
CHUNK_TOKENS = 1024

_pool: ThreadPoolExecutor | None = None
_lock = threading.Lock()


def _executor() -> ThreadPoolExecutor:
    global _pool
    with _lock:
        if _pool is None:  # a few threads: both layers of a step may prefetch at once
            _pool = ThreadPoolExecutor(4, thread_name_prefix="row-prefetch")
        return _pool


def is_io_bound(store) -> bool:
    """Whether `store`'s lookups wait on a device (an SSD tier, or a stack/cache whose first read goes there)."""
    return bool(getattr(store, "io_bound", False))


def submit_lookup(store, addresses: np.ndarray, dtype: torch.dtype = torch.bfloat16):
    """`store.lookup(addresses)` started on a background thread: a Future of the rows."""
    return _executor().submit(store.lookup, addresses, dtype)


def chunk_bounds(tokens: int, chunk_tokens: int, min_tokens: int = 0) -> list[tuple[int, int]]:
    """[start, end) chunks of `chunk_tokens`; a last chunk of at most `min_tokens` joins the one
    before it (so every chunk of a long prompt stays longer than `min_tokens`)."""
    bounds = [(s, min(s + chunk_tokens, tokens)) for s in range(0, tokens, chunk_tokens)]
    if len(bounds) > 1 and bounds[-1][1] - bounds[-1][0] <= min_tokens:
        bounds[-2:] = [(bounds[-2][0], tokens)]
    return bounds


def pipelined_lookup(store, addresses: np.ndarray, chunk_tokens: int = CHUNK_TOKENS,
                     dtype: torch.dtype = torch.bfloat16, min_tokens: int = 0):
    """Yields (start, end, rows [end-start, C*D]) over the tokens of `addresses` [T, C], the
    lookup of chunk i+1 running while the caller holds chunk i (chunks: chunk_bounds)."""
    a = np.asarray(addresses)
    bounds = chunk_bounds(a.shape[0], chunk_tokens, min_tokens)
    if not bounds:
        return
    pool = _executor()
    nxt = pool.submit(store.lookup, a[bounds[0][0]:bounds[0][1]], dtype)
    try:
        for i, (s, e) in enumerate(bounds):
            rows = nxt.result()
            nxt = pool.submit(store.lookup, a[bounds[i + 1][0]:bounds[i + 1][1]], dtype) if i + 1 < len(bounds) else None
            yield s, e, rows
    finally:
        if nxt is not None:  # the caller stopped early (an error while projecting): let the read finish
            nxt.cancel() or nxt.exception()
