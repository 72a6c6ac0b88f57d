"""Decode timing model (docs/architecture.md, "Timing model"): how late Engram K/V slows a decode step.

Per token the backbone takes W ms over 40 blocks; table 0 is read by block 1 and table 1 by
block 14, and the model (docs/architecture.md) gives the fetches windows w0 = W/40 and
w1 = 13W/40. A late table costs only its overshoot: T = W + max(0, f0 − w0) + max(0, f1 − w1).
(Block 14 actually starts 14W/40 into the step; the model's 13W/40 is one block conservative.)
"""
from __future__ import annotations

import dataclasses
import math

from engramflow.errors import EngramflowError

# Named storage paths: per-table fetch time in ms (f0 = f1), as measured on the project's machines.
PATHS_MS: dict[str, float] = {
    "internal-ssd": 6 * 0.068,
    "external-ssd": 6 * 0.0986,
    "remote-ram-20gbps": 0.1,
    "wifi": 4.0,
    "constant-1.5ms": 1.5,
    "spinning-disk": 30.0,
}


@dataclasses.dataclass(frozen=True)
class Prediction:
    base_tps: float
    path: str
    f0_ms: float
    f1_ms: float
    tokens_per_s: float
    slowdown: float


WINDOW_BLOCKS = (1, 13)  # w0 = 1·W/40, w1 = 13·W/40 (docs/architecture.md, "Timing model")


def windows_ms(base_ms: float, n_blocks: int = 40, window_blocks: tuple[int, int] = WINDOW_BLOCKS) -> tuple[float, float]:
    """The fetch windows w0, w1 the model allows each table."""
    return base_ms * window_blocks[0] / n_blocks, base_ms * window_blocks[1] / n_blocks


def step_ms(base_ms: float, f0_ms: float, f1_ms: float, n_blocks: int = 40,
            window_blocks: tuple[int, int] = WINDOW_BLOCKS, chained: bool = False) -> float:
    """Step time. `chained=False` is the timing model as written (docs/architecture.md): overshoots add. `chained=True`
    lets a stall at table 0 push back table 1's window too (the backbone reaches block 14
    late by the same amount), which matters when both tables are late: the additive formula
    then counts the overlapping part of the two waits twice."""
    w0, w1 = windows_ms(base_ms, n_blocks, window_blocks)
    late0 = max(0.0, f0_ms - w0)
    return base_ms + late0 + max(0.0, f1_ms - w1 - (late0 if chained else 0.0))


def predict(base_tps: float, f0_ms: float, f1_ms: float, path: str = "custom", **kw) -> Prediction:
    """kw: n_blocks, window_blocks, chained (see step_ms)."""
    for name, v in (("base tokens/s", base_tps), ("f0_ms", f0_ms), ("f1_ms", f1_ms)):
        if not (math.isfinite(v) and v >= 0) or (name == "base tokens/s" and v == 0):
            raise EngramflowError(f"{name} must be a finite positive number, got {v!r}")
    base_ms = 1000.0 / base_tps
    t = step_ms(base_ms, f0_ms, f1_ms, **kw)
    return Prediction(base_tps, path, f0_ms, f1_ms, 1000.0 / t, t / base_ms)


def path_fetch_ms(name: str, measured: dict[str, float] | None = None) -> float:
    """Fetch time of a named path; `measured` adds paths from the project's benchmarks."""
    table = PATHS_MS | (measured or {})
    if name not in table:
        raise EngramflowError(f"unknown storage path {name!r}; known: {', '.join(sorted(table))}")
    return table[name]
