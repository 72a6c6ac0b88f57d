"""What the in-process Engine and the Ray Pipeline share: sessions, input checks, chunked
prefill, batched decode, and steps in flight.

A backend implements one batched forward step (`_submit` hands it over, `_collect` waits for
its result; an in-process backend computes at submit) and the session operations on its
components; this class owns the driver-side truth: each session's token log (what replay
rebuilds from) and length. A step's writes enter the log when it is collected; a session is
in at most one uncollected step, so the log of every session not in flight is complete.
Everything a user passes is checked here *before* any component changes, so a bad call
leaves every session as it was. A session operation is recorded in the log first and then
sent to the components (idempotently); a fault part-way is repaired by reconciling the
components to the log (Recovery.sync, recovery.py), never the other way round.
"""
from __future__ import annotations

import contextlib
import itertools

import numpy as np
import torch

from engramflow.errors import EngramflowError
from engramflow.memory.image_spans import spans_to_mask
from engramflow.model.vision import clip_slots
from engramflow.io.token_map import as_token_ids
from engramflow.io.config import ModelConfig
from engramflow.model.sampling import Pick, Picked, Sampling, verifies
from engramflow.pipeline.generation import Generation, generate
from engramflow.pipeline.image_inputs import encode_slots, expand, prepare_images
from engramflow.pipeline.session_log import SessionLog
from engramflow.pipeline.step import Request, StepResult, Ticket
from engramflow.scheduling.request import add_waits
from engramflow.sessions import new_session_name, session_entry
from engramflow.validate import check_int


class Runner:
    cfg: ModelConfig
    prefill_chunk: int = 512
    speculative: int | None = None  # DSpark tokens drafted per step (None: plain decoding)
    speculative_gate: float | None = None  # adaptive: the confidence a draft needs (speculative.ConfidenceGate)
    config = None  # the EngineConfig / PipelineConfig it was made from (pipeline/config.py)
    vision_cfg = None  # a VisionConfig when the checkpoint has a vision tower

    def __init__(self):
        self.session_logs: dict[str, SessionLog] = {}  # session -> its writes: the driver's truth
        self._names = itertools.count()
        self.last_waits: dict[int, float] = {}  # exposed wait per layer of the last step
        self.prefill_waits: dict[int, float] = {}  # ... summed over the last prefill's chunks
        self.outstanding: dict[str, Ticket] = {}  # session -> the uncollected step holding it
        self.bytes_moved: dict[int, int] = {}  # Engram bytes shipped to the stages per layer, all steps so far
        self.in_flight_default = 1  # steps generate() keeps in flight unless told
        self._defer_ops = False  # see deferred_session_ops

    # -- backend hooks -----------------------------------------------------------------------
    def _submit(self, ticket: Ticket) -> None:
        """Hand a step over, recording in the ticket what `_collect` needs (an in-process
        backend computes now and sets `ticket.result`)."""
        raise NotImplementedError

    def _collect(self, ticket: Ticket) -> StepResult:
        return ticket.result

    def _session_op(self, op: str, *args: str) -> None:
        raise NotImplementedError

    def drafts(self, asks: list[tuple]) -> list:
        """DSpark drafts of several sessions, each ask (session, token, start, n, sampling,
        stream, step); here `_draft` one at a time (Engine and Pipeline: one forward for all)."""
        return [self._draft(*ask) for ask in asks]

    def _encode_image(self, image) -> object:
        """A PreparedImage -> its span rows (a tensor, or a reference the stage resolves)."""
        raise EngramflowError("this runner takes no images")

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: list[int]) -> str:
        raise NotImplementedError

    # -- sessions ----------------------------------------------------------------------------
    def _out_of_sync(self) -> None:
        """A session op failed part-way: the components may disagree with the log. A backend
        that can reconcile them to the log (the Pipeline) does so before its next call."""

    def _apply(self, op: str, args: tuple, session: str, new_log: SessionLog | None, keep_on_error: bool) -> None:
        """The log first (the truth that recovery reconciles to), then the components. If the
        components fail, the log goes back to what it was -- except for a close, which always
        ends the session: its leftovers on the components are closed at the next reconcile."""
        busy = [s for s in args if s in self.outstanding]
        if busy:
            raise EngramflowError(f"session {busy[0]!r} has a step in flight; collect it before {op}")
        before = self.session_logs.get(session)
        if new_log is None:
            del self.session_logs[session]
        else:
            self.session_logs[session] = new_log
        try:
            self._session_op(op, *args)
        except BaseException:
            if not keep_on_error:
                if before is None:
                    self.session_logs.pop(session, None)
                else:
                    self.session_logs[session] = before
            self._out_of_sync()
            raise

    def open(self, session: str | None = None) -> str:
        session = self._new_name(session)
        self._apply("open", (session,), session, SessionLog(), keep_on_error=False)
        return session

    def fork(self, src: str, dst: str | None = None) -> str:
        src_log = self._require(src)
        dst = self._new_name(dst)
        self._apply("fork", (src, dst), dst, src_log.copy(), keep_on_error=False)
        return dst

    def reset(self, session: str) -> None:
        self._require(session)
        self._apply("reset", (session,), session, SessionLog(), keep_on_error=False)

    def close(self, session: str) -> None:
        self._require(session)
        self._apply("close", (session,), session, None, keep_on_error=True)

    def length(self, session: str) -> int:
        return self._require(session).length

    def rollback(self, session: str, length: int) -> None:
        """Drop the session's positions from `length` on, in the log and every component."""
        log = self._require(session)
        check_int(f"rollback length of session {session!r}", length, 0, log.length)
        if length < log.length:
            kept = log.copy()
            kept.truncate(length)
            self._apply("truncate", (session, length), session, kept, keep_on_error=False)

    def tokens(self, session: str) -> list[int]:
        return self._require(session).tokens()

    def segments(self, session: str) -> list:
        """The session's writes in order: replaying them rebuilds its state anywhere."""
        return list(self._require(session).segments)

    @property
    def sessions(self) -> list[str]:
        return list(self.session_logs)

    def _new_name(self, session: str | None) -> str:
        return new_session_name(session, self.session_logs, self._names)

    def _require(self, session: str) -> SessionLog:
        return session_entry(self.session_logs, session)

    # -- checked forward ---------------------------------------------------------------------
    def request(self, session: str, ids, start_pos: int | None = None, image_spans=None,
                pick: Pick | None = None, images=None) -> Request:
        """A checked write of `ids` at `start_pos` (default: the end) of a session. With
        `images`, each image placeholder id in `ids` becomes that image's span."""
        log = self._require(session)
        if isinstance(ids, str):
            raise EngramflowError("token ids must be a sequence of integers, got a string (use encode())")
        arr = as_token_ids(ids, self.cfg.vocab_size)
        if arr.size == 0:
            raise EngramflowError(f"empty prompt for session {session!r}")
        pos = log.length if start_pos is None else start_pos
        if isinstance(pos, bool) or not isinstance(pos, (int, np.integer)) or not 0 <= pos <= log.length:
            raise EngramflowError(f"start_pos={start_pos!r} is outside [0, {log.length}] for session {session!r}")
        if images is not None:
            if image_spans:
                raise EngramflowError("pass images (their spans follow) or image_spans, not both")
            arr, dead, spans = expand(arr, prepare_images(images, self.vision_cfg), self.vision_cfg,
                                      self.cfg.max_seq_len, int(pos))
            return Request(session, arr, int(pos), dead, pick, encode_slots(spans, self._encode_image))
        if pos + arr.size > self.cfg.max_seq_len:
            raise EngramflowError(
                f"session {session!r} would hold {pos + arr.size} tokens, above max_seq_len={self.cfg.max_seq_len}")
        dead = spans_to_mask(image_spans, arr.size) if image_spans else None
        return Request(session, arr, int(pos), dead, pick)

    # -- steps in flight ----------------------------------------------------------------------
    def submit(self, requests: list[Request]) -> Ticket:
        """Hand a checked step to the backend without waiting for it. Each session may be in
        one uncollected step at a time (its next write depends on this one's place in the log)."""
        if len({r.session for r in requests}) != len(requests):
            raise EngramflowError("a step may hold each session once")
        for r in requests:
            self._require(r.session)
            if r.session in self.outstanding:
                raise EngramflowError(f"session {r.session!r} already has a step in flight")
        ticket = Ticket(requests)
        self._submit(ticket)
        self.outstanding |= {r.session: ticket for r in requests}
        return ticket

    def collect(self, ticket: Ticket) -> StepResult:
        """Wait for a submitted step; its writes enter the log now."""
        if any(self.outstanding.get(r.session) is not ticket for r in ticket.requests):
            raise EngramflowError("this step is not in flight (already collected or abandoned)")
        result = self._collect(ticket)
        for r in ticket.requests:
            del self.outstanding[r.session]
            self.session_logs[r.session].write(r.start_pos, r.ids, r.dead, verifies(r.pick), r.images)
        self.last_waits = result.exposed_wait_ms
        add_waits(self.bytes_moved, result.bytes_moved)
        return result

    @contextlib.contextmanager
    def deferred_session_ops(self):
        """Within it, a backend need not wait for session operations to reach its components
        (a schedule of steps opens and closes sessions all the time; each op is ordered before
        the steps submitted after it anyway). The driver checks every argument first, so only
        a fault can fail such an op: it surfaces when a later step is collected, and recovery
        reconciles the components to the log, which already holds the op."""
        before, self._defer_ops = self._defer_ops, True
        try:
            yield
        finally:
            self._defer_ops = before
            if not before:
                self._deferral_ended()

    def _deferral_ended(self) -> None:
        """A backend that held session ops back sends what is left now."""

    def abandon(self) -> None:
        """Forget every uncollected step (after an error part-way through a schedule): their
        writes never enter the log, and components that may hold them are reconciled to it."""
        if self.outstanding:
            self.outstanding.clear()
            self._abandoned()

    def _abandoned(self) -> None:
        """In-process components follow the log by themselves: the next write of a session
        names its start_pos and truncates there. A remote backend reconciles (Pipeline)."""

    def run_step(self, requests: list[Request]) -> StepResult:
        return self.collect(self.submit(requests))

    def prefill_requests(self, session: str, ids, start_pos: int | None = None, image_spans=None,
                         pick: Pick | None = None, images=None) -> list[Request]:
        """A checked prompt as its chunks, one single-request step each; the last one carries
        `pick`."""
        req = self.request(session, ids, start_pos, image_spans, images=images)
        chunks = []
        for a in range(0, req.ids.size, self.prefill_chunk):
            b = min(req.ids.size, a + self.prefill_chunk)
            dead = None if req.dead is None else req.dead[a:b]
            chunks.append(Request(session, req.ids[a:b], req.start_pos + a, dead, images=clip_slots(req.images, a, b)))
        chunks[-1].pick = pick
        return chunks

    def prefill(self, session: str, ids, start_pos: int | None = None, image_spans=None,
                pick: Pick | None = None, images=None) -> torch.Tensor | Picked:
        """Write a prompt in chunks; returns the fp32 logits after its last token (or, given a
        `pick`, what it picks from them). `images` (bytes, paths or PIL images) fill the
        prompt's image placeholders in order."""
        chunks = self.prefill_requests(session, ids, start_pos, image_spans, pick, images)
        logits = None
        self.prefill_waits = {}  # exposed wait per layer, summed over this prompt's chunks
        try:
            for chunk in chunks:
                logits = self.run_step([chunk]).logits[0]
                add_waits(self.prefill_waits, self.last_waits)
        except BaseException:
            # no half-written prompt: the log goes back to where it was (components follow,
            # since the next write names its start_pos and truncates there)
            if session in self.session_logs:
                self.session_logs[session].truncate(chunks[0].start_pos)
            raise
        return logits

    def decode_step(self, tokens: dict[str, int]) -> dict[str, torch.Tensor]:
        """One lockstep step: each session appends one token; returns each one's next logits."""
        if not tokens:
            raise EngramflowError("decode_step needs at least one session")
        reqs = [self.request(s, [t], None) for s, t in tokens.items()]
        result = self.run_step(reqs)
        return dict(zip(tokens, result.logits))

    def generate(self, prompts: list, max_new_tokens: int = 16, sampling: Sampling | None = None,
                 image_spans: list | None = None, keep_sessions: bool = False,
                 in_flight: int | None = None, images: list | None = None) -> list[Generation]:
        """Prefill each prompt (text or ids) in its own session, then decode. The sessions are
        split into `in_flight` groups (default: the backend's, e.g. a pipeline's stage count),
        each with one step in flight; the tokens do not depend on it. Sessions are closed at
        the end unless keep_sessions (then Generation.session names them). `images`: per prompt,
        a list of images (bytes, paths or PIL images) for its image placeholders, or None."""
        return generate(self, prompts, max_new_tokens, sampling, image_spans, keep_sessions, in_flight, images)
