"""What the in-process Engine and the Ray Pipeline share: sessions, input checks, chunked
prefill and lockstep batched decode.

A backend implements one batched forward step (`_step`) and the session operations on its
components; this class owns the driver-side truth: each session's token log (what replay
rebuilds from) and length. Everything a user passes is checked here *before* any component
changes, so a bad call leaves every session as it was. A session operation is recorded in the
log first and then sent to the components (idempotently); a fault part-way is repaired by
reconciling the components to the log (Pipeline._sync), never the other way round.
"""
from __future__ import annotations

import dataclasses
import itertools
import time

import numpy as np
import torch

from engramflow.errors import EngramflowError
from engramflow.memory.image_spans import spans_to_mask
from engramflow.io.token_map import as_token_ids
from engramflow.io.config import ModelConfig
from engramflow.pipeline.sampling import Sampling, choose
from engramflow.pipeline.session_log import SessionLog
from engramflow.sessions import new_session_name, session_entry


@dataclasses.dataclass
class Request:
    """One session's slice of a step: tokens written at start_pos."""
    session: str
    ids: np.ndarray  # int64 [T]
    start_pos: int
    dead: np.ndarray | None = None  # bool [T], image positions


@dataclasses.dataclass
class StepResult:
    """Per request: fp32 logits of its last position; per Engram layer: exposed wait (ms)."""
    logits: list[torch.Tensor]
    exposed_wait_ms: dict[int, float]
    spans: list = dataclasses.field(default_factory=list)
    bytes_moved: dict[int, int] = dataclasses.field(default_factory=dict)  # Engram bytes shipped to the stages, per layer


@dataclasses.dataclass
class Generation:
    session: str
    prompt_ids: list[int]
    tokens: list[int]
    text: str
    seconds: float
    exposed_wait_ms: dict[int, float]

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / self.seconds if self.seconds > 0 else 0.0


MAX_BLOCK_MS = 1000.0  # emulated backbone: a second per block is already far slower than any real block


def check_run_options(block_ms: float, prefill_chunk: int) -> None:
    """Options both runners take, checked before anything is built."""
    if isinstance(block_ms, bool) or not isinstance(block_ms, (int, float)) or not 0 <= block_ms <= MAX_BLOCK_MS:
        raise EngramflowError(f"block_ms must be a number of ms in [0, {MAX_BLOCK_MS:g}], got {block_ms!r}")
    if isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int) or prefill_chunk < 1:
        raise EngramflowError(f"prefill_chunk must be an integer >= 1, got {prefill_chunk!r}")


def _prompt_ids(prompt, encode) -> list:
    if isinstance(prompt, str):
        return encode(prompt)
    if isinstance(prompt, (list, tuple, np.ndarray)):
        return list(prompt)
    raise EngramflowError(f"a prompt must be text or a list of token ids, got {type(prompt).__name__}")


class Runner:
    cfg: ModelConfig
    prefill_chunk: int = 512

    def __init__(self):
        self._log: dict[str, SessionLog] = {}  # session -> its writes: the driver's truth
        self._names = itertools.count()
        self.last_waits: dict[int, float] = {}  # exposed wait per layer of the last step
        self.prefill_waits: dict[int, float] = {}  # ... summed over the last prefill's chunks
        self.bytes_moved: dict[int, int] = {}  # Engram bytes shipped to the stages per layer, all steps so far

    # -- backend hooks -----------------------------------------------------------------------
    def _step(self, requests: list[Request]) -> StepResult:
        raise NotImplementedError

    def _session_op(self, op: str, *args: str) -> None:
        raise NotImplementedError

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
        before = self._log.get(session)
        if new_log is None:
            del self._log[session]
        else:
            self._log[session] = new_log
        try:
            self._session_op(op, *args)
        except BaseException:
            if not keep_on_error:
                if before is None:
                    self._log.pop(session, None)
                else:
                    self._log[session] = before
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

    def tokens(self, session: str) -> list[int]:
        return self._require(session).tokens()

    def segments(self, session: str) -> list:
        """The session's writes in order: replaying them rebuilds its state anywhere."""
        return list(self._require(session).segments)

    @property
    def sessions(self) -> list[str]:
        return list(self._log)

    def _new_name(self, session: str | None) -> str:
        return new_session_name(session, self._log, self._names)

    def _require(self, session: str) -> SessionLog:
        return session_entry(self._log, session)

    # -- checked forward ---------------------------------------------------------------------
    def _request(self, session: str, ids, start_pos: int | None, image_spans=None) -> Request:
        log = self._require(session)
        if isinstance(ids, str):
            raise EngramflowError("token ids must be a sequence of integers, got a string (use encode())")
        arr = as_token_ids(ids, self.cfg.vocab_size)
        if arr.size == 0:
            raise EngramflowError(f"empty prompt for session {session!r}")
        pos = log.length if start_pos is None else start_pos
        if isinstance(pos, bool) or not isinstance(pos, (int, np.integer)) or not 0 <= pos <= log.length:
            raise EngramflowError(f"start_pos={start_pos!r} is outside [0, {log.length}] for session {session!r}")
        if pos + arr.size > self.cfg.max_seq_len:
            raise EngramflowError(
                f"session {session!r} would hold {pos + arr.size} tokens, above max_seq_len={self.cfg.max_seq_len}")
        dead = spans_to_mask(image_spans, arr.size) if image_spans else None
        return Request(session, arr, int(pos), dead)

    def _run(self, requests: list[Request]) -> StepResult:
        if len({r.session for r in requests}) != len(requests):
            raise EngramflowError("a step may hold each session once")
        result = self._step(requests)
        for r in requests:
            self._log[r.session].write(r.start_pos, r.ids, r.dead)
        self.last_waits = result.exposed_wait_ms
        for layer, n in result.bytes_moved.items():
            self.bytes_moved[layer] = self.bytes_moved.get(layer, 0) + n
        return result

    def prefill(self, session: str, ids, start_pos: int | None = None, image_spans=None) -> torch.Tensor:
        """Write a prompt in chunks; returns the fp32 logits after its last token."""
        req = self._request(session, ids, start_pos, image_spans)
        logits = None
        self.prefill_waits = {}  # exposed wait per layer, summed over this prompt's chunks
        try:
            for a in range(0, req.ids.size, self.prefill_chunk):
                b = min(req.ids.size, a + self.prefill_chunk)
                dead = None if req.dead is None else req.dead[a:b]
                logits = self._run([Request(session, req.ids[a:b], req.start_pos + a, dead)]).logits[0]
                for layer, ms in self.last_waits.items():
                    self.prefill_waits[layer] = self.prefill_waits.get(layer, 0.0) + ms
        except BaseException:
            # no half-written prompt: the log goes back to where it was (components follow,
            # since the next write names its start_pos and truncates there)
            if session in self._log:
                self._log[session].truncate(req.start_pos)
            raise
        return logits

    def decode_step(self, tokens: dict[str, int]) -> dict[str, torch.Tensor]:
        """One lockstep step: each session appends one token; returns each one's next logits."""
        if not tokens:
            raise EngramflowError("decode_step needs at least one session")
        reqs = [self._request(s, [t], None) for s, t in tokens.items()]
        result = self._run(reqs)
        return dict(zip(tokens, result.logits))

    def generate(self, prompts: list, max_new_tokens: int = 16, sampling: Sampling | None = None,
                 image_spans: list | None = None, keep_sessions: bool = False) -> list[Generation]:
        """Prefill each prompt (text or ids) in its own session, then decode all in lockstep.
        Sessions are closed at the end unless keep_sessions (then Generation.session names them)."""
        sampling = sampling or Sampling()
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise EngramflowError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
        if not prompts:
            raise EngramflowError("no prompts given")
        prompt_ids = [_prompt_ids(p, self.encode) for p in prompts]
        spans = image_spans or [None] * len(prompts)
        if len(spans) != len(prompts):
            raise EngramflowError(f"{len(spans)} image span lists for {len(prompts)} prompts")
        for ids, sp in zip(prompt_ids, spans):  # validate every prompt before opening anything
            arr = as_token_ids(ids, self.cfg.vocab_size)
            if arr.size == 0:
                raise EngramflowError("empty prompt")
            if arr.size + max_new_tokens > self.cfg.max_seq_len:
                raise EngramflowError(
                    f"prompt of {arr.size} tokens + {max_new_tokens} new exceeds max_seq_len={self.cfg.max_seq_len}")
            if sp:
                spans_to_mask(sp, arr.size)
        names: list[str] = []
        t0 = time.perf_counter()
        waits: dict[int, list[float]] = {}
        try:
            names.extend(self.open() for _ in prompts)
            last = [self.prefill(s, ids, image_spans=sp) for s, ids, sp in zip(names, prompt_ids, spans)]
            gens = [sampling.generator(i) for i in range(len(names))]
            out: list[list[int]] = [[] for _ in names]
            nxt = [choose(lg, sampling, g) for lg, g in zip(last, gens)]
            for step in range(max_new_tokens):
                for o, t in zip(out, nxt):
                    o.append(t)
                if step == max_new_tokens - 1:
                    break
                logits = self.decode_step(dict(zip(names, nxt)))
                for layer, ms in self.last_waits.items():
                    waits.setdefault(layer, []).append(ms)
                nxt = [choose(logits[s], sampling, g) for s, g in zip(names, gens)]
        finally:
            if not keep_sessions:
                for s in names:
                    try:
                        self.close(s)
                    except EngramflowError:  # do not hide the error that got us here
                        pass
        seconds = time.perf_counter() - t0
        mean_waits = {layer: float(np.mean(v)) for layer, v in waits.items()}
        return [Generation(s, list(map(int, ids)), o, self.decode(o), seconds, mean_waits)
                for s, ids, o in zip(names, prompt_ids, out)]
