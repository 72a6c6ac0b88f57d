"""`engramflow profile`: a traced workload with py-spy on every actor, and all the outputs.

Workload: one prompt prefilled chunk by chunk, then greedy decode steps until the duration
ends, each forward a traced step (StepTracer). Meanwhile py-spy samples every actor process.
Outputs in the folder: trace.json (Perfetto / chrome://tracing), overlap.txt / overlap.json,
gantt.png, flamegraphs/<actor>.svg and .speedscope.json, summary.json.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import ray

from engramflow.profiling import pyspy
from engramflow.profiling.gantt import draw_gantt
from engramflow.profiling.overlap import format_table, overlap_rows, report
from engramflow.profiling.step_tracer import StepTracer
from engramflow.profiling.trace import write_json_atomic, write_trace

DEFAULT_PROMPT = ("Engram memory lets a model look up n-gram facts in huge tables while the backbone "
                  "runs, so the projection of the looked-up rows hides behind the early blocks. ") * 2


def actor_processes(pipe) -> dict[str, int]:
    """Track name -> pid of every actor. Ray's state API (ray.util.state.list_actors) needs the
    dashboard, which a local pipeline starts without; asking each actor works everywhere."""
    def ident(actor_self):
        return actor_self.spans.track, os.getpid()

    return dict(ray.get([a.__ray_call__.remote(ident) for a in pipe.actors()]))


def greedy_token(logits) -> int:
    from engramflow.pipeline.sampling import Sampling, choose

    return choose(logits, Sampling(), None)


def run_workload(tracer: StepTracer, prompt_ids: list[int], duration_s: float, min_decode_steps: int = 3) -> int:
    """Prefill, then decode until the time is up; returns the number of decode steps."""
    pipe = tracer.pipe
    session = pipe.open()
    try:
        end = time.monotonic() + duration_s
        token = greedy_token(tracer.prefill(session, prompt_ids))
        steps = 0
        room = pipe.cfg.max_seq_len - len(prompt_ids)
        while steps < room and (time.monotonic() < end or steps < min_decode_steps):
            token = greedy_token(tracer.decode_step({session: token})[session])
            steps += 1
        return steps
    finally:
        pipe.close(session)


def run_profile(checkpoint: str | Path, out_dir: str | Path, duration_s: float = 10.0, backbone: str = "emulated",
                block_ms: float = 2.0, stages: int = 1, address: str | None = None, prompt: str = DEFAULT_PROMPT,
                prefill_chunk: int = 512, projection_delay_ms: dict[int, float] | None = None,
                pyspy_rate: int = 100, log=print) -> dict:
    from engramflow.pipeline.pipeline import Pipeline

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    pipe = Pipeline.launch(checkpoint, stages=stages, address=address, backbone=backbone, block_ms=block_ms,
                           prefill_chunk=prefill_chunk, projection_delay_ms=projection_delay_ms)
    try:
        tracer = StepTracer(pipe)
        prompt_ids = pipe.encode(prompt)
        run_workload(tracer, prompt_ids[:8], 0.0, min_decode_steps=1)  # warm-up: first calls pay imports
        tracer.collect()
        targets = actor_processes(pipe)
        recs = pyspy.start(targets, duration_s, out / "flamegraphs", rate=pyspy_rate)
        for reason in pyspy.failed_early(recs):
            log(reason)
        decode_steps = run_workload(tracer, prompt_ids, duration_s)
        spans = tracer.collect()
        profiles = pyspy.finish(recs, duration_s, out / "flamegraphs")
    finally:
        pipe.shutdown()
    rows = overlap_rows(spans)
    write_trace(out / "trace.json", spans)
    (out / "overlap.txt").write_text(format_table(rows) + "\n")
    write_json_atomic(out / "overlap.json", report(rows))
    draw_gantt(spans, out / "gantt.png", title=f"{Path(checkpoint).name}: {backbone} backbone, block {block_ms} ms")
    summary = {
        "checkpoint": str(checkpoint), "backbone": backbone, "block_ms": block_ms, "stages": stages,
        "duration_s": duration_s, "prompt_tokens": len(prompt_ids), "decode_steps": decode_steps,
        "actors": targets, "clock_offsets_us": {str(p): o.offset_ns / 1e3 for p, o in tracer.offsets.items()},
        "trace": str(out / "trace.json"), "gantt": str(out / "gantt.png"),
        "overlap": {"text": str(out / "overlap.txt"), "json": str(out / "overlap.json")},
        "overlap_summary": report(rows)["summary"],
        "profiles": {p.name: {"pid": p.pid, "svg": p.svg and str(p.svg), "samples": p.samples,
                              "speedscope": p.speedscope and str(p.speedscope), "error": p.error} for p in profiles},
    }
    write_json_atomic(out / "summary.json", summary)
    return summary
