"""Driver-side step spans, and one place that gathers every span onto the driver's clock.

The overlap report measures everything from the moment the driver *submits* a step, which
only the driver knows; so the tracer records a "step" span per forward (one per prefill chunk,
so each chunk is one submit): as the scheduler's hooks (`submitted`, `collected`: the profile's
workload, scheduled as the server schedules), or around the runner's own primitives (`prefill`,
`decode_step`: tests and benchmarks that step by hand). At `collect` it merges those with the
actors' spans after moving them onto the driver clock.
"""
from __future__ import annotations

import collections
import itertools
import time

from engramflow.profiling.clock import align, measure_offsets
from engramflow.timeline import SpanRecorder


class StepTracer:
    def __init__(self, pipe):
        self.pipe = pipe
        self.recorder = SpanRecorder("driver")
        if getattr(pipe, "dataflow", None) is not None:
            pipe.dataflow.marks = self.recorder  # "send history", "send stage", "result" (hops.py)
        self._index = itertools.count()
        self.offsets = {}
        self._open: collections.deque = collections.deque()  # (start ns, kind, tokens) of steps in flight

    def _traced(self, kind: str, tokens: int, fn):
        with self.recorder.span("step", kind=kind, step=next(self._index), tokens=tokens):
            return fn()

    def prefill(self, session: str, ids: list[int]):
        """Prefill chunk by chunk, one traced step each; returns the last chunk's logits."""
        chunk, logits = self.pipe.prefill_chunk, None
        for a in range(0, len(ids), chunk):
            part = ids[a:a + chunk]
            logits = self._traced("prefill", len(part), lambda: self.pipe.prefill(session, part))
        return logits

    def decode_step(self, tokens: dict[str, int]):
        return self._traced("decode", len(tokens), lambda: self.pipe.decode_step(tokens))

    # -- the scheduler's hooks: each of its steps a traced step ----------------------------------
    def submitted(self, work) -> None:
        """Scheduler.on_submit: a step is about to be submitted (its span starts now)."""
        kinds = {step_kind(req, write) for req, write in work}
        kind = kinds.pop() if len(kinds) == 1 else "mixed"
        self._open.append((time.time_ns(), kind, sum(int(w.ids.size) for _, w in work)))

    def collected(self, result, work) -> None:
        """Scheduler.on_step: the oldest step in flight came back (steps come back in order)."""
        start, kind, tokens = self._open.popleft()
        self.recorder.add("step", start, time.time_ns(), kind=kind, step=next(self._index), tokens=tokens)

    def collect(self) -> list[dict]:
        """Drain every actor and the driver; spans come back on the driver's clock."""
        self.offsets = measure_offsets(self.pipe.actors())
        spans = align(self.pipe.drain_spans(), self.offsets) + self.recorder.drain()
        return sorted(spans, key=lambda s: s["start_ns"])


def step_kind(req, write) -> str:
    """What a scheduler's write is: a verify block, a prompt chunk (it starts inside the prompt)
    or a decode."""
    from engramflow.model.sampling import verifies

    if verifies(write.pick):
        return "verify"
    return "prefill" if write.start_pos < len(req.prompt_ids) else "decode"
