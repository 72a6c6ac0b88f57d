"""Driver-side step spans, and one place that gathers every span onto the driver's clock.

The overlap report measures everything from the moment the driver *submits* a step, which
only the driver knows; so the tracer wraps prefill and decode, records a "step" span per
forward (one per prefill chunk, so each chunk is one submit), and at `collect` merges those
with the actors' spans after moving them onto the driver clock.
"""
from __future__ import annotations

import itertools

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

    def decode_picked(self, session: str, token: int, step: int) -> int:
        """One greedy decode step picked on the last stage, as the server's steps are: the
        last hop carries a token, not the full-vocabulary logits."""
        from engramflow.model.sampling import Pick

        request = self.pipe.request(session, [token], pick=Pick(step=step))
        return self._traced("decode", 1, lambda: self.pipe.run_step([request])).logits[0].token

    def speculative_step(self, spec, token: int, produced: int, wanted: int) -> list[int]:
        """One speculative step of a session (scheduling/speculation.SessionSpeculation): the
        draft (a driver span "draft", not a step: it is one call to the last stage), then the
        verify block as a traced step of kind "verify"; returns the emitted tokens."""
        with self.recorder.span("draft", produced=produced):
            request = spec.request(token, produced, wanted)
        result = self._traced("verify", int(request.ids.size), lambda: self.pipe.run_step([request]))
        return spec.settle(result.logits[0])

    def collect(self) -> list[dict]:
        """Drain every actor and the driver; spans come back on the driver's clock."""
        self.offsets = measure_offsets(self.pipe.actors())
        spans = align(self.pipe.drain_spans(), self.offsets) + self.recorder.drain()
        return sorted(spans, key=lambda s: s["start_ns"])
