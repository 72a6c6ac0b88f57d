"""The hop floor of bench_serve.py: each per-step actor hop of a decode step (the profile's hop
report: driver -> history -> projections -> stages -> driver) against a bare Ray actor round
trip carrying the same payload (one token's hidden state), measured in the same run.

The decode steps pick their token on the last stage, as the server's steps do (the last hop
carries a token, not 129,280 fp32 logits through the object store). The two are measured in
alternating rounds, with the echo actor alive beside the pipeline's
from the start: a shared 2-core VM drifts by 2x within a minute, and a bare round trip timed
after the workload compared hops with another machine's round trip."""
from __future__ import annotations

import statistics
import time

import numpy as np
import ray


@ray.remote(num_cpus=0)
class Echo:
    def echo(self, x):
        return x


def bare_round_trips_ms(actor, payload: np.ndarray, n: int) -> list[float]:
    times = []
    for _ in range(n):
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
        tracer, bare_ms = StepTracer(pipe), []
        for _ in range(rounds):
            run_workload(tracer, list(range(100, 140)), seconds / rounds, picked=True)  # as the server
            bare_ms += bare_round_trips_ms(echo, payload, 50)
        report = hop_report(tracer.collect()).get("decode", {})
        bare = statistics.median(bare_ms)
    finally:
        ray.kill(echo)
        pipe.shutdown()
    hops = report.get("median_ms", {})
    worst = max(hops.values(), default=float("nan"))
    return {"bare_round_trip_ms": bare, "hop_median_ms": hops, "worst_hop_ms": worst,
            "worst_hop_over_bare": worst / bare, "steps": report.get("steps", 0),
            "driver_work_median_ms": report.get("driver_median_ms", {})}
