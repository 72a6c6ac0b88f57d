"""`engramflow profile`: a traced workload with py-spy on every actor, and all the outputs.

Workload: one greedy request through the scheduler, as the server runs it: its prompt
prefilled chunk by chunk, then decode steps picked on the last stage until the duration ends,
each forward a traced step (StepTracer's scheduler hooks). With `speculative`, each decode step
is a DSpark draft and a verify step instead, and the summary gains the speculative stats. Meanwhile py-spy samples every actor process.
Outputs in the folder: trace.json (Perfetto / chrome://tracing), overlap.txt / overlap.json,
gantt.png, flamegraphs/<actor>.svg and .speedscope.json, summary.json.

Options are checked before anything is made; the outputs are written to `.profile.partial`
inside the output folder and moved into place only when the run has succeeded, so a failed run
leaves the folder as it was (and removes it, and any folder above it, if this run made them).
A `.profile.partial` left by a killed run is cleared by the next run.
"""
from __future__ import annotations

import dataclasses
import math
import os
import shutil
import time
from pathlib import Path

import ray

from engramflow.errors import EngramflowError
from engramflow.io.atomic import missing_dirs, remove_made_dirs
from engramflow.pipeline.config import Emulation, PipelineConfig, check_known

from engramflow.profiling import pyspy
from engramflow.profiling.gantt import draw_gantt
from engramflow.profiling.hops import format_hops, hop_report
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
    from engramflow.model.sampling import Sampling, choose

    return choose(logits, Sampling(), None)


def run_workload(tracer: StepTracer, prompt_ids: list[int], duration_s: float, min_decode_steps: int = 3) -> tuple:
    """One greedy request through the scheduler (prefill chunk by chunk, then decode until the
    time is up), each step traced; the last stage picks each token, as in serving. A pipeline
    launched with `speculative` drafts and verifies, as the server does. Returns the number of
    decode (or verify) steps and the scheduler's SpeculativeStats (None without speculation)."""
    from engramflow.model.sampling import Pick
    from engramflow.scheduling.request import Collect, Request
    from engramflow.scheduling.scheduler import Scheduler

    pipe, end = tracer.pipe, time.monotonic() + duration_s
    steps = []  # decode (or verify) steps collected so far

    def on_step(result, work):
        steps.extend(w for _, w in work if w.start_pos >= len(prompt_ids))

    class UntilTimeIsUp(Collect):
        def on_token(self, picked):
            over = time.monotonic() >= end and len(steps) >= min_decode_steps
            return super().on_token(picked) or ("length" if over else None)

    sink = UntilTimeIsUp(pipe.cfg.max_seq_len - len(prompt_ids))
    scheduler = Scheduler(pipe, on_step=on_step, tracer=tracer)
    scheduler.add(Request(list(prompt_ids), lambda step: Pick(step=step), sink))
    scheduler.drain()
    if sink.error is not None:
        raise EngramflowError(sink.error)
    return len(steps), scheduler.speculative_stats


PROFILE_BLOCK_MS = 2.0  # the emulated backbone's block time in a profile built from keywords
MAX_DURATION_S = 3600.0  # an hour of workload and sampling; more is a typo, not a profile
MAX_RATE = 10_000  # py-spy samples per second
STAGE = ".profile.partial"
OUTPUTS = ("trace.json", "overlap.txt", "overlap.json", "gantt.png", "flamegraphs", "summary.json")


def describe_backbone(backbone: str, emulation: Emulation, pipe) -> str:
    """The backbone as a title states it: its kind and the parameters that shape the run."""
    cfg = pipe.cfg
    stages = f"{len(pipe.blocks)} stage{'s' if len(pipe.blocks) != 1 else ''}"
    if backbone == "emulated":
        return f"emulated backbone ({cfg.n_layers} blocks sleeping {emulation.block_ms:g} ms each), {stages}"
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


def run_profile(config: PipelineConfig | str | Path, out_dir: str | Path, *, duration_s: float = 10.0,
                prompt: str = DEFAULT_PROMPT, pyspy_rate: int = 100, log=print, idle: bool = False,
                **options) -> dict:
    """Profile the pipeline of `config` (a PipelineConfig, or a checkpoint and the keywords
    PipelineConfig.build takes; block_ms defaults to PROFILE_BLOCK_MS there). Its backbone None:
    what the checkpoint is (v41 for a V4.1 checkpoint, else reference), as `generate` picks it;
    its `speculative`: decode with the DSpark draft layers. `idle`: keep idle and waiting stacks
    in the flame graphs."""
    from engramflow.model.backbones import default_backbone
    from engramflow.pipeline.pipeline import Pipeline

    if isinstance(config, PipelineConfig):
        check_known(options)
    else:
        config = PipelineConfig.build(config, **{"block_ms": PROFILE_BLOCK_MS} | options)
    check_profile_options(duration_s, pyspy_rate, out_dir)
    engine = config.engine
    config = dataclasses.replace(config, engine=dataclasses.replace(
        engine, backbone=engine.backbone or default_backbone(engine.checkpoint)))
    out = Path(out_dir)
    stage = out / STAGE  # where this run writes until it has succeeded
    made = missing_dirs(out)
    try:
        if stage.exists():  # left by a killed run: ours by name, start over
            shutil.rmtree(stage)
        stage.mkdir(parents=True)
        # the pipeline validates the checkpoint, backbone and stages before any actor starts
        pipe = Pipeline.launch(config)
        summary = _profile(pipe, stage, out, config, duration_s, prompt, pyspy_rate, log, idle)
        _publish(stage, out)
        return summary
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        remove_made_dirs(made)  # folders this run made on the way
        raise


def _profile(pipe, stage: Path, out: Path, config: PipelineConfig, duration_s: float, prompt: str, pyspy_rate: int,
             log, idle: bool = False) -> dict:
    """The traced run; shuts `pipe` down. Writes into `stage`; the summary names the final paths in `out`."""
    checkpoint, backbone, emulation = config.engine.checkpoint, config.engine.backbone, config.engine.emulation
    try:
        tracer = StepTracer(pipe)
        prompt_ids = pipe.encode(prompt)
        run_workload(tracer, prompt_ids[:8], 0.0, min_decode_steps=1)  # warm-up: first calls pay imports
        tracer.collect()
        targets = actor_processes(pipe)
        recs = pyspy.start(targets, duration_s, stage / "flamegraphs", rate=pyspy_rate)
        for reason in pyspy.failed_early(recs):
            log(reason)
        decode_steps, stats = run_workload(tracer, prompt_ids, duration_s)
        spans = tracer.collect()
        title = f" — {Path(checkpoint).name}, {describe_backbone(backbone, emulation, pipe)}"
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
    draw_gantt(spans, stage / "gantt.png", title=f"{Path(checkpoint).name}: {describe_backbone(backbone, emulation, pipe)}")
    summary = {
        "checkpoint": str(checkpoint), "backbone": backbone,
        "block_ms": emulation.block_ms if backbone == "emulated" else None, "stages": config.stages, "idle_stacks": idle,
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
