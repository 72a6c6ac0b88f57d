"""Decode-step figures for bench_v41.py: one step holding 1, 4, 16 and 64 sessions on the
`v41-small` preset (dim 128, the real 129,280-token vocabulary: the head is the step's largest
weight), in the default batched numerics (one forward per step) and in official numerics
(one forward per session, as every step ran before batching), same run. Each figure is the
best of `repeat` steps after every session has prefilled a short prompt; the ratio is the step
time over the 1-session step of the same numerics.
"""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from engramflow.model.synth import make_checkpoint
from engramflow.pipeline.engine import Engine

PRESET_DIR = Path(__file__).resolve().parent.parent / "checkpoints" / "v41-small"
SESSIONS = (1, 4, 16, 64)
PROMPT = 24


def preset_checkpoint() -> Path:
    if not (PRESET_DIR / "config.json").is_file():
        make_checkpoint("v41-small", PRESET_DIR, seed=0, progress=False)
    return PRESET_DIR


def step_ms(engine: Engine, n: int, repeat: int) -> float:
    rng = np.random.default_rng(n)
    sessions = [engine.open() for _ in range(n)]
    try:
        for s in sessions:
            engine.prefill(s, rng.integers(1000, 100_000, PROMPT).tolist())
        best = float("inf")
        for _ in range(repeat):
            tokens = {s: int(t) for s, t in zip(sessions, rng.integers(1000, 100_000, n))}
            t0 = time.perf_counter()
            engine.decode_step(tokens)
            best = min(best, time.perf_counter() - t0)
        return best * 1e3
    finally:
        for s in sessions:
            engine.close(s)


def session_figures(repeat: int, sessions=SESSIONS) -> list[dict]:
    ckpt = preset_checkpoint()
    rows = []
    for numerics in ("batched", "official"):
        engine = Engine(ckpt, numerics=numerics)
        try:
            step_ms(engine, 1, 2)  # warm-up: weights packed, buffers made
            ms = {n: step_ms(engine, n, repeat) for n in sessions}
        finally:
            engine.shutdown()
        rows += [{"numerics": numerics, "sessions": n, "step ms": ms[n], "vs 1 session": ms[n] / ms[1],
                  "tok/s": n / ms[n] * 1e3} for n in sessions]
    return rows
