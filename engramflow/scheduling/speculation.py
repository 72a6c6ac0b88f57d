"""Speculative decoding with the DSpark draft layers: draft k tokens, verify them in one forward.

A session stands at length L with its next token t chosen but not yet written. One step:
  1. the last stage drafts d_1..d_k after t (the draft layers read the main model's taps of
     every position < L);
  2. the block [t, d_1..d_k] is written at L in one forward through every stage (its Engram
     rows are looked up and projected like any chunk's) and the target logits of each of its
     positions come back;
  3. the longest acceptable prefix d_1..d_m is kept (model/speculative.py) and the next token
     chosen from row m;
  4. positions L+1+m .. L+k are rolled back everywhere: the driver's log, the history, every
     stage's caches (window, compressor carry and rows, index keys, the draft layers' rings).
     Every cache is rows by position, so the session is then bit for bit one that never drafted.
The driver's log therefore only ever holds accepted tokens once a step is done.

Options: pipeline/speculative.py. The runner provides `drafts(asks)`, each ask (session, token,
start, n, sampling, stream, step): the stage holding the draft layers (in process, or the
pipeline's last stage actor) drafts every session of a step in one forward of the draft layers,
each session's rows its own (batched numerics). The verification is an
ordinary step whose request carries the `Verify` pick, so it is submitted and collected like any
step, and recovery replays a verified segment as a verified block (the log marks it).

Steps in flight. A session's next block depends on its last verdict, so each session has at
most one step in flight; with several sessions, up to `in_flight` of their steps are in flight
at once (stage g verifies one session's block while stage g+1 verifies another's), as plain
decoding's are: the scheduler drives both. A session's draft call queues behind the steps
already on the last stage (actors run calls in order) and reads only ring rows of positions <
its start, so it needs no held-back rollback to have arrived; the rollback rides with the next
step's calls. Tokens do not depend on `in_flight`: every draw is seeded by (seed, stream, step).

`SessionSpeculation` is one session's draft-and-verdict logic; the scheduler calls it for every
request that drafts (`speculation_for` below says which). With `adaptive`, its
`ConfidenceGate` decides which steps draft (the cost), never the tokens.

Which requests draft: a request drafts when the runner was launched with `--speculative` and its
token choice is the runner's own `Pick` (greedy or temperature / top-k): then the verdict draws
exactly what plain sampling would for the same prompt and seed. A request with `top_p` or
`logit_bias` decodes plainly (the acceptance rule would need those applied to both
distributions), so its tokens stay those of plain decoding.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import time

import numpy as np
import torch

from engramflow.model.sampling import Pick, Picked, Sampling
from engramflow.model.speculative import ACCEPT_SALT, Verify, accept_greedy, accept_sampled


@dataclasses.dataclass
class SpeculativeStats:
    steps: int = 0
    draft_steps: int = 0  # steps that drafted (the last ones may not: never past what is asked for)
    gated: int = 0  # steps the adaptive gate kept from drafting (a plain decode step instead)
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_step(self) -> float:
        return self.emitted / self.steps if self.steps else 0.0

    def add(self, drafted: int, accepted: int, verify_s: float) -> None:
        """One verified step: `accepted` of its `drafted` tokens kept, plus the next token."""
        self.steps += 1
        self.drafted += drafted
        self.accepted += accepted
        self.emitted += accepted + 1
        self.verify_s += verify_s

    def as_dict(self) -> dict:
        return dataclasses.asdict(self) | {"acceptance": self.acceptance, "tokens_per_step": self.tokens_per_step}


class ConfidenceGate:
    """Adaptive mode: draft only while the draft layers are confident. The first drafted token's
    confidence (a logit: its sigmoid is the draft layers' own estimate that it is right) is read
    after each draft; below the threshold, the next steps decode plainly (no draft cost). The
    gate must look again some time, so it waits 1 step, then 2, 4, up to MAX_WAIT while the
    drafts it sees stay unconfident, and drafts every step again after a confident one."""
    MAX_WAIT = 8

    def __init__(self, threshold: float):
        self.threshold, self.wait, self.backoff = threshold, 0, 0

    def allows(self) -> bool:
        """Whether this step drafts (asked once per step that could draft)."""
        if self.wait:
            self.wait -= 1
            return False
        return True

    def observe(self, draft) -> None:
        if draft is None or not len(draft.tokens):
            return
        if 1 / (1 + math.exp(-float(draft.confidence[0]))) >= self.threshold:
            self.backoff = 0
        else:
            self.backoff = min(2 * self.backoff or 1, self.MAX_WAIT)
            self.wait = self.backoff


def verify(runner, session: str, ids: list[int], start: int) -> torch.Tensor:
    """Write the block at `start` in one step through every stage; every position's logits [T, V]."""
    return runner.run_step([runner.request(session, np.asarray(ids, dtype=np.int64), start, pick=Verify())]).logits[0]


class SessionSpeculation:
    """One session's speculative steps, driven by the scheduler: `plan` says what to draft (the
    scheduler drafts every session's asks in one call), `block` makes the verify block, `settle` turns the block's target
    rows into the emitted tokens (the verdict) and rolls back the rejected positions. Draws are
    seeded by (seed, stream, this session's step count), so the tokens do not depend on who
    drives the steps."""

    def __init__(self, runner, session: str, sampling: Sampling, stream: int, stats: SpeculativeStats,
                 constraint=None):
        self.runner, self.session, self.sampling, self.stream, self.stats = runner, session, sampling, stream, stats
        self.constraint = constraint  # a request's grammar (structured/constraint.py): it masks the target rows
        self.rows = None  # the last settled block's target rows, as the verdict saw them (masked)
        threshold = runner.speculative_gate
        self.gate = ConfidenceGate(threshold) if threshold is not None else None
        self.step = 0
        self.last_counts = (0, 0)  # (drafted, accepted) of the last settled step
        self._block = None  # (start, draft, submitted at) of the step in flight

    def plan(self, token: int, produced: int, wanted: int) -> tuple | None:
        """This step's draft ask (session, token, start, n, sampling, stream, step), or None when
        it does not draft; `produced` of `wanted` tokens emitted so far (token included), so at
        most wanted - produced - 1 drafts. The scheduler drafts every ask of a step together."""
        n = max(0, min(self.runner.speculative, wanted - produced - 1))  # never draft past what is asked for
        if n and self.gate is not None and not self.gate.allows():
            n = 0
            self.stats.gated += 1
        start = self.runner.length(self.session)
        self._planned = (token, start, n)
        return (self.session, token, start, n, self.sampling, self.stream, self.step) if n else None

    def block(self, draft):
        """The verify block [token] + the drafts at the session's end (the planned token)."""
        token, start, n = self._planned
        self.stats.draft_steps += bool(n)
        if self.gate is not None:
            self.gate.observe(draft)
        drafts = draft.tokens if draft is not None else []
        self._block = (start, draft, time.perf_counter())  # an in-process runner computes the step in submit
        return self.runner.request(self.session, [token] + drafts, start, pick=Verify())

    def settle(self, target: torch.Tensor) -> list[int]:
        """The step's rows [k+1, V] -> the kept drafts and the next token."""
        start, draft, t1 = self._block
        drafts = draft.tokens if draft is not None else []
        if self.constraint is not None:  # a refused draft is rejected, the next token is allowed
            target = self.constraint.mask_block(target, drafts)
        self.rows = target
        if self.sampling.greedy:
            verdict = accept_greedy(target, drafts)
        else:
            verdict = accept_sampled(target, draft.logits if draft is not None else None, drafts, self.sampling,
                                     self.sampling.generator(self.stream ^ ACCEPT_SALT, self.step))
        keep = start + 1 + verdict.accepted
        if keep < start + 1 + len(drafts):
            self.runner.rollback(self.session, keep)  # a pipeline holds it back: it rides with the next step
        self.stats.add(len(drafts), verdict.accepted, time.perf_counter() - t1)
        self.last_counts = (len(drafts), verdict.accepted)
        self.step += 1
        return drafts[:verdict.accepted] + [verdict.next_token]



def draft_all(runner, asks: list[tuple], stats: SpeculativeStats, recorder=None) -> list:
    """The drafts of every ask, in one call (one forward of the draft layers on a real stage);
    `recorder` (a profile's SpanRecorder) gets a "draft" span for the call."""
    if not asks:  # nothing drafts this step (or the runner does not speculate: no stats)
        return []
    t0 = time.perf_counter()
    with recorder.span("draft", sessions=len(asks)) if recorder is not None else contextlib.nullcontext():
        drafts = runner.drafts(asks)
    stats.draft_s += time.perf_counter() - t0
    return drafts


def decode_writes(runner, reqs: list, stats: SpeculativeStats | None, recorder=None) -> list:
    """(request, its write) for each decoding scheduler request: its next token, or its verify
    block, the drafting requests' drafts all made in one call (one forward of the draft layers)."""
    asks = {id(r): r.speculation.plan(r.last_token, r.generated, _wanted(runner, r))
            for r in reqs if r.speculation is not None}
    drafts = iter(draft_all(runner, [a for a in asks.values() if a is not None], stats, recorder))
    return [(r, runner.request(r.session, [r.last_token], pick=r.pick_at(r.generated)) if r.speculation is None
             else r.speculation.block(next(drafts) if asks[id(r)] is not None else None)) for r in reqs]


def _wanted(runner, req) -> int:
    """How many tokens a drafting request may still reach: the block must fit the model (at most
    its room - 1 drafts) and never pass max_tokens."""
    room = req.generated + runner.cfg.max_seq_len - runner.length(req.session)
    return room if req.max_tokens is None else min(req.max_tokens, room)


def speculation_for(runner, job, stats: SpeculativeStats) -> SessionSpeculation | None:
    """The job's speculative state once its session is open, or None when it decodes plainly."""
    if runner.speculative is None:
        return None
    pick = job.pick(0)
    if type(pick) is not Pick:  # top_p / logit_bias: BiasedPick (serve/picking.py)
        return None
    return SessionSpeculation(runner, job.session, pick.sampling, pick.stream, stats, job.constraint)


def picked_rows(target: torch.Tensor, tokens: list[int], logprobs: int) -> list[Picked]:
    """The sink's Picked for emitted token i, chosen from target row i (rows [k+1, V]); with
    `logprobs`, the same log-probabilities a plain decode step's Pick reports for that row."""
    if not logprobs:
        return [Picked(t) for t in tokens]
    out = []
    for row, t in zip(target, tokens):
        lp = torch.log_softmax(row.float(), dim=-1)
        top = torch.topk(lp, min(logprobs, lp.numel()))
        out.append(Picked(t, float(lp[t]), tuple(top.indices.tolist()), tuple(top.values.tolist())))
    return out
