"""The hop floor of bench_serve.py: each per-step actor hop of a decode step (the profile's hop
report: driver -> history -> projections -> stages -> driver) against a bare Ray actor round
trip carrying the same payload (one token's hidden state), measured in the same run.

The decode steps pick their token on the last stage, as the server's steps do (the last hop
carries a token, not 129,280 fp32 logits through the object store). The two are measured in
alternating rounds, with the echo actor alive beside the pipeline's
from the start: a shared 2-core VM drifts by 2x within a minute, and a bare round trip timed
after the workload compared hops with another machine's round trip.

Two bare round trips: back to back (the machine kept busy by the round trips themselves), and
each after an idle gap as long as one stage's blocks sleep. Every hop of a step follows such a
gap (the stages sleep as GPUs would, the driver waits), and on a VM whose idle vCPUs halt the
wake-up that follows costs as much as the round trip itself: on the 2-vCPU Firecracker VM of
BENCHMARKS.md a bare round trip takes ~1.0 ms back to back and ~2.9 ms after 8 ms idle. The
round trip after the same idle time is the like-for-like floor of a hop; both are reported."""
from __future__ import annotations

import statistics
import time

import numpy as np
import ray


IDLE_SWEEP_MS = (0, 0.5, 2, 8, 30)  # idle gaps before a bare round trip: the wake-up cost


@ray.remote(num_cpus=0)
class Echo:
    def echo(self, x):
        return x


def bare_round_trips_ms(actor, payload: np.ndarray, n: int, idle_s: float = 0.0) -> list[float]:
    times = []
    for _ in range(n):
        if idle_s:
            time.sleep(idle_s)
        t = time.perf_counter()
        ray.get(actor.echo.remote(payload))
        times.append((time.perf_counter() - t) * 1e3)
    return times


def hop_floor(ckpt, stages: int, block_ms: float, seconds: float, rounds: int = 4) -> dict:
    from engramflow.pipeline.pipeline import Pipeline
    from engramflow.profiling.hops import hop_report
    from engramflow.profiling.profile_run import run_workload
    from engramflow.profiling.step_tracer import StepTracer

    pipe = Pipeline.launch(ckpt, stages=stages, backbone="emulated", block_ms=block_ms)
    echo = Echo.remote()
    try:
        payload = np.zeros((1, pipe.cfg.hc_mult, pipe.cfg.dim), dtype=np.int16)  # one token's bf16 hidden state
        ray.get(echo.echo.remote(payload))
        tracer, bare_ms, idle_ms = StepTracer(pipe), [], []
        gap_s = max(len(b) for b in pipe.blocks) * block_ms / 1e3  # one stage's blocks
        for _ in range(rounds):
            run_workload(tracer, list(range(100, 140)), seconds / rounds)  # scheduled as the server schedules
            bare_ms += bare_round_trips_ms(echo, payload, 50)
            idle_ms += bare_round_trips_ms(echo, payload, 25, idle_s=gap_s)
        report = hop_report(tracer.collect()).get("decode", {})
        bare, bare_idle = statistics.median(bare_ms), statistics.median(idle_ms)
        by_idle = {gap: statistics.median(bare_round_trips_ms(echo, payload, 25, idle_s=gap / 1e3))
                   for gap in IDLE_SWEEP_MS}
    finally:
        ray.kill(echo)
        pipe.shutdown()
    hops = report.get("median_ms", {})
    worst = max(hops.values(), default=float("nan"))
    return {"bare_round_trip_ms": bare, "hop_median_ms": hops, "worst_hop_ms": worst,
            "worst_hop_over_bare": worst / bare, "idle_gap_ms": gap_s * 1e3, "bare_after_idle_ms": bare_idle,
            "worst_hop_over_bare_after_idle": worst / bare_idle, "bare_round_trip_by_idle_ms": by_idle,
            "steps": report.get("steps", 0),
            "driver_work_median_ms": report.get("driver_median_ms", {})}
