"""Measure how fast a projection runs here: the numbers `projection="auto"` decides from.

`measure(run, tokens)` times `run(T)` (one projection of T positions) at T = 1 (the decode
regime: a GEMV bound by the weight stream) and at T = `tokens` (the prefill regime: a GEMM bound
by the matmul rate), the median of a few after a warm-up call (what a step meets, where the best
would be the luckiest moment of a shared machine), and returns
{"decode_s": seconds at T = 1, "per_token_s": seconds per position at T = tokens, "tokens": T}.
`random_rows(T, cfg)` makes valid MXFP8 rows to feed a stage's projector.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import numpy as np

from engramflow.model.engram_rows import EngramRows

CALIBRATION_TOKENS = 512  # the default prefill chunk


def _median(fn: Callable[[], object], repeat: int, sync: Callable[[], None] | None = None) -> float:
    fn()  # warm: thread pools, first-touch, a weight copy made on first use
    if sync:
        sync()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        if sync:
            sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(run: Callable[[int], object], tokens: int = CALIBRATION_TOKENS, repeat: int = 3,
            sync: Callable[[], None] | None = None) -> dict:
    decode_s = _median(lambda: run(1), repeat + 2, sync)
    prefill_s = _median(lambda: run(tokens), repeat, sync)
    return {"decode_s": decode_s, "per_token_s": prefill_s / tokens, "tokens": tokens}


def random_rows(tokens: int, columns: int, head_dim: int, seed: int = 0) -> EngramRows:
    """Rows with every E4M3 code finite and scales near 1 (what a table holds)."""
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 256, (tokens, columns, head_dim), dtype=np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x7E
    scales = rng.integers(120, 130, (tokens, columns, head_dim // 32), dtype=np.uint8)
    return EngramRows(codes, scales)
