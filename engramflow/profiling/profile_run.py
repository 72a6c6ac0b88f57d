"""`engramflow profile`: a traced workload with py-spy on every actor, and all the outputs.

Workload: one prompt prefilled chunk by chunk, then greedy decode steps until the duration
ends, each forward a traced step (StepTracer). With `speculative`, each decode step is a DSpark
draft and a verify step instead, and the summary gains the speculative stats. Meanwhile py-spy samples every actor process.
Outputs in the folder: trace.json (Perfetto / chrome://tracing), overlap.txt / overlap.json,
gantt.png, flamegraphs/<actor>.svg and .speedscope.json, summary.json.

Options are checked before anything is made; the outputs are written to `.profile.partial`
inside the output folder and moved into place only when the run has succeeded, so a failed run
leaves the folder as it was (and removes it, and any folder above it, if this run made them).
A `.profile.partial` left by a killed run is cleared by the next run.
"""
from __future__ import annotations

import math
import os
import shutil
import time
from pathlib import Path

import ray

from engramflow.errors import EngramflowError
from engramflow.io.atomic import missing_dirs, remove_made_dirs

from engramflow.profiling import pyspy
from engramflow.profiling.gantt import draw_gantt
from engramflow.profiling.hops import format_hops, hop_report
from engramflow.profiling.overlap import format_table, overlap_rows, report
from engramflow.profiling.step_tracer import StepTracer
from engramflow.profiling.trace import write_json_atomic, write_trace
from engramflow.scheduling.speculation import SpeculativeStats

DEFAULT_PROMPT = ("Engram memory lets a model look up n-gram facts in huge tables while the backbone "
                  "runs, so the projection of the looked-up rows hides behind the early blocks. ") * 2


def actor_processes(pipe) -> dict[str, int]:
    """Track name -> pid of every actor. Ray's state API (ray.util.state.list_actors) needs the
    dashboard, which a local pipeline starts without; asking each actor works everywhere."""
    def ident(actor_self):
        return actor_self.spans.track, os.getpid()

    return dict(ray.get([a.__ray_call__.remote(ident) for a in pipe.actors()]))


def greedy_token(logits) -> int:
    from engramflow.model.sampling import Sampling, choose

    return choose(logits, Sampling(), None)


def run_workload(tracer: StepTracer, prompt_ids: list[int], duration_s: float, min_decode_steps: int = 3,
                 stats=None, picked: bool = False) -> int:
    """Prefill, then decode until the time is up; returns the number of decode steps. A pipeline
    launched with `speculative` drafts and verifies (its stats go to `stats`, a SpeculativeStats).
    `picked`: the last stage picks each greedy token, as in serving (decode steps only)."""
    from engramflow.model.sampling import Sampling
    from engramflow.scheduling.speculation import SessionSpeculation, SpeculativeStats

    pipe = tracer.pipe
    session = pipe.open()
    try:
        end = time.monotonic() + duration_s
        token = greedy_token(tracer.prefill(session, prompt_ids))
        steps, produced = 0, 1
        room = pipe.cfg.max_seq_len - len(prompt_ids)
        spec = None if pipe.speculative is None else SessionSpeculation(
            pipe, session, Sampling(), 0, SpeculativeStats() if stats is None else stats)
        while steps < room and produced < room and (time.monotonic() < end or steps < min_decode_steps):
            if spec is None:
                token = (tracer.decode_picked(session, token, produced) if picked
                         else greedy_token(tracer.decode_step({session: token})[session]))
                produced += 1
            else:
                emitted = tracer.speculative_step(spec, token, produced, room)
                token, produced = emitted[-1], produced + len(emitted)
            steps += 1
        return steps
    finally:
        pipe.close(session)


MAX_DURATION_S = 3600.0  # an hour of workload and sampling; more is a typo, not a profile
MAX_RATE = 10_000  # py-spy samples per second
STAGE = ".profile.partial"
OUTPUTS = ("trace.json", "overlap.txt", "overlap.json", "gantt.png", "flamegraphs", "summary.json")


def describe_backbone(backbone: str, block_ms: float, pipe) -> str:
    """The backbone as a title states it: its kind and the parameters that shape the run."""
    cfg = pipe.cfg
    stages = f"{len(pipe.blocks)} stage{'s' if len(pipe.blocks) != 1 else ''}"
    if backbone == "emulated":
        return f"emulated backbone ({cfg.n_layers} blocks sleeping {block_ms:g} ms each), {stages}"
    return (f"{backbone} backbone ({cfg.n_layers} layers, dim {cfg.dim}, Engram at layers "
            f"{', '.join(map(str, cfg.engram_layer_ids))}), {stages}, projection {pipe.placement.mode}")


def check_profile_options(duration_s, pyspy_rate, out_dir) -> None:
    """Raise EngramflowError naming the first bad option; nothing is touched."""
    if isinstance(duration_s, bool) or not isinstance(duration_s, (int, float)) or not (
            math.isfinite(duration_s) and 0 < duration_s <= MAX_DURATION_S):
        raise EngramflowError(f"duration must be > 0 and <= {MAX_DURATION_S:g} seconds, got {duration_s!r}")
    if isinstance(pyspy_rate, bool) or not isinstance(pyspy_rate, int) or not 1 <= pyspy_rate <= MAX_RATE:
        raise EngramflowError(f"py-spy rate must be an integer in [1, {MAX_RATE}] samples per second, "
                              f"got {pyspy_rate!r}")
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise EngramflowError(f"output folder {out} exists and is not a folder")
    for name in OUTPUTS:
        dest, want_dir = out / name, name == "flamegraphs"
        if dest.exists() and dest.is_dir() != want_dir:
            raise EngramflowError(f"cannot write {dest}: it is {'not ' if want_dir else ''}a folder")


def _publish(stage: Path, out: Path) -> None:
    """Move the finished outputs from `stage` into `out` (replacing a previous run's)."""
    for entry in stage.iterdir():
        dest = out / entry.name
        if entry.is_dir() and dest.is_dir():
            shutil.rmtree(dest)
        os.replace(entry, dest)
    stage.rmdir()


def run_profile(checkpoint: str | Path, out_dir: str | Path, duration_s: float = 10.0, backbone: str | None = None,
                block_ms: float = 2.0, stages: int = 1, address: str | None = None, prompt: str = DEFAULT_PROMPT,
                prefill_chunk: int = 512, projection_delay_ms: dict[int, float] | None = None,
                pyspy_rate: int = 100, log=print, projection: str = "host", idle: bool = False,
                speculative: str | None = None) -> dict:
    """`backbone` None: what the checkpoint is (v41 for a V4.1 checkpoint, else reference), as
    `generate` picks it. `idle`: keep idle and waiting stacks in the flame graphs. `speculative`:
    decode with the DSpark draft layers ("dspark[:K][:exact][:adaptive[=P]]", as `generate`)."""
    from engramflow.model.backbones import default_backbone
    from engramflow.pipeline.pipeline import Pipeline

    check_profile_options(duration_s, pyspy_rate, out_dir)
    backbone = backbone or default_backbone(checkpoint)
    out = Path(out_dir)
    stage = out / STAGE  # where this run writes until it has succeeded
    made = missing_dirs(out)
    try:
        if stage.exists():  # left by a killed run: ours by name, start over
            shutil.rmtree(stage)
        stage.mkdir(parents=True)
        # the pipeline validates the checkpoint, backbone, stages and block_ms before any actor starts
        pipe = Pipeline.launch(checkpoint, stages=stages, address=address, backbone=backbone, block_ms=block_ms,
                               prefill_chunk=prefill_chunk, projection_delay_ms=projection_delay_ms,
                               projection=projection, speculative=speculative)
        summary = _profile(pipe, stage, out, checkpoint, duration_s, backbone, block_ms, stages, prompt,
                           pyspy_rate, log, idle)
        _publish(stage, out)
        return summary
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        remove_made_dirs(made)  # folders this run made on the way
        raise


def _profile(pipe, stage: Path, out: Path, checkpoint, duration_s: float, backbone: str, block_ms: float,
             stages: int, prompt: str, pyspy_rate: int, log, idle: bool = False) -> dict:
    """The traced run; shuts `pipe` down. Writes into `stage`; the summary names the final paths in `out`."""
    try:
        tracer = StepTracer(pipe)
        prompt_ids = pipe.encode(prompt)
        run_workload(tracer, prompt_ids[:8], 0.0, min_decode_steps=1)  # warm-up: first calls pay imports
        tracer.collect()
        targets = actor_processes(pipe)
        recs = pyspy.start(targets, duration_s, stage / "flamegraphs", rate=pyspy_rate)
        for reason in pyspy.failed_early(recs):
            log(reason)
        stats = SpeculativeStats()
        decode_steps = run_workload(tracer, prompt_ids, duration_s, stats=stats)
        spans = tracer.collect()
        title = f" — {Path(checkpoint).name}, {describe_backbone(backbone, block_ms, pipe)}"
        profiles = pyspy.finish(recs, duration_s, stage / "flamegraphs", idle=idle, title=title)
    finally:
        pipe.shutdown()

    def final(path) -> str | None:  # a path in stage -> where it will be once published
        return path and str(out / Path(path).relative_to(stage))

    rows = overlap_rows(spans)
    hops = hop_report(spans)
    write_trace(stage / "trace.json", spans)
    (stage / "overlap.txt").write_text(format_table(rows) + "\n\nactor hops per step (critical path):\n"
                                       + format_hops(hops) + "\n")
    write_json_atomic(stage / "overlap.json", report(rows) | {"hops": hops})
    draw_gantt(spans, stage / "gantt.png", title=f"{Path(checkpoint).name}: {describe_backbone(backbone, block_ms, pipe)}")
    summary = {
        "checkpoint": str(checkpoint), "backbone": backbone, "block_ms": block_ms if backbone == "emulated" else None,
        "stages": stages, "idle_stacks": idle,
        "duration_s": duration_s, "prompt_tokens": len(prompt_ids), "decode_steps": decode_steps,
        "actors": targets, "clock_offsets_us": {str(p): o.offset_ns / 1e3 for p, o in tracer.offsets.items()},
        "trace": str(out / "trace.json"), "gantt": str(out / "gantt.png"),
        "overlap": {"text": str(out / "overlap.txt"), "json": str(out / "overlap.json")},
        "overlap_summary": report(rows)["summary"], "hops": hops, "projection": pipe.placement.mode,
        "bytes_moved": {str(k): v for k, v in sorted(pipe.bytes_moved.items())},
        "profiles": {p.name: {"pid": p.pid, "svg": final(p.svg), "samples": p.samples,
                              "speedscope": final(p.speedscope), "error": p.error} for p in profiles},
    }
    if pipe.speculative is not None:
        summary["speculative"] = {"draft_tokens": pipe.speculative, "gate": pipe.speculative_gate} | stats.as_dict()
    write_json_atomic(stage / "summary.json", summary)
    return summary
