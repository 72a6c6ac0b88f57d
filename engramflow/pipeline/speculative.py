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

The runner provides `_draft(session, token, start, n, sampling, stream, step)` (the stage holding
the draft layers: in process, or the pipeline's last stage actor); the verification is an
ordinary step whose request carries the `Verify` pick, so it is submitted and collected like any
step, and recovery replays a verified segment as a verified block (the log marks it).

Steps in flight. A session's next block depends on its last verdict, so each session has at most
one speculative step in flight; with several sessions, up to `in_flight` of their steps are in
flight at once (stage g verifies one session's block while stage g+1 verifies another's), exactly
as plain decoding's groups do. A session's draft call queues behind the steps already on the last
stage (actors run calls in order) and reads only ring rows of positions < its start, so it needs
no held-back rollback to have arrived; the rollback rides with the next step's calls. Tokens do
not depend on `in_flight`: every draw is seeded by (seed, stream, step).
"""
from __future__ import annotations

import collections
import dataclasses
import time

import numpy as np
import torch

from engramflow.errors import EngramflowError
from engramflow.model.sampling import Sampling, choose
from engramflow.model.speculative import ACCEPT_SALT, Verify, accept_greedy, accept_sampled


def parse_speculative(spec: str | None) -> tuple[int, bool] | None:
    """'dspark[:K][:exact]' -> (K, exact); K 0 = the draft block size. None/''/'off' = off.
    `exact`: verified blocks run row by row (bit-equal to plain decoding on any kernels)."""
    if spec is None or spec == "" or spec == "off":
        return None
    parts = spec.split(":") if isinstance(spec, str) else []
    exact = bool(parts) and parts[-1] == "exact"
    parts = parts[:-1] if exact else parts
    if not parts or parts[0] != "dspark" or len(parts) > 2 or (len(parts) == 2 and not (parts[1].isdigit()
                                                                                       and int(parts[1]) >= 1)):
        raise EngramflowError(f"speculative must be 'dspark', 'dspark:K' or 'dspark[:K]:exact' with K >= 1, "
                              f"got {spec!r}")
    return (int(parts[1]) if len(parts) == 2 else 0), exact


def check_draft_tokens(k: int, block_size: int) -> int:
    """k drafted tokens per step (0: the whole block); at most the draft layers' block size."""
    if k > block_size:
        raise EngramflowError(f"speculative dspark:{k} drafts more than the draft layers' block of {block_size}")
    return k or block_size


def draft_block_size(checkpoint) -> int:
    """The draft layers' block size from config.json (0 when the model has none)."""
    from engramflow.io.config import load_raw

    raw = load_raw(checkpoint)
    raw = {**raw, **raw["text_config"]} if isinstance(raw.get("text_config"), dict) else raw
    size = raw.get("dspark_block_size", 0)
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise EngramflowError(f"{checkpoint}: speculative decoding needs DSpark draft layers "
                              f"(config dspark_block_size is {size!r})")
    return size


@dataclasses.dataclass
class SpeculativeStats:
    steps: int = 0
    draft_steps: int = 0  # steps that drafted (the last ones may not: never past what is asked for)
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

    def as_dict(self) -> dict:
        return dataclasses.asdict(self) | {"acceptance": self.acceptance, "tokens_per_step": self.tokens_per_step}


def verify(runner, session: str, ids: list[int], start: int) -> torch.Tensor:
    """Write the block at `start` in one step through every stage; every position's logits [T, V]."""
    return runner._run([runner.request(session, np.asarray(ids, dtype=np.int64), start, pick=Verify())]).logits[0]


@dataclasses.dataclass
class _Stream:
    """One session's speculative decode: `token` is chosen, not yet written."""
    session: str
    stream: int
    token: int
    tokens: list[int]
    step: int = 0


def _submit(runner, st: _Stream, max_new: int, sampling: Sampling, stats: SpeculativeStats):
    """Draft (on the stage holding the draft layers), then submit the block's verification."""
    n = min(runner.speculative, max_new - len(st.tokens) - 1)  # never draft past what is asked for
    start = runner.length(st.session)
    t0 = time.perf_counter()
    draft = runner._draft(st.session, st.token, start, n, sampling, st.stream, st.step) if n else None
    stats.draft_s += time.perf_counter() - t0
    stats.draft_steps += bool(n)
    block = [st.token] + (draft.tokens if draft is not None else [])
    t1 = time.perf_counter()  # before the submit: an in-process runner computes the step in it
    ticket = runner.submit([runner.request(st.session, np.asarray(block, dtype=np.int64), start, pick=Verify())])
    return st, ticket, draft, start, t1


def _finish(runner, pending, sampling: Sampling, stats: SpeculativeStats) -> _Stream:
    """Collect a verification; keep the accepted prefix, roll the rest back, choose the next token."""
    st, ticket, draft, start, t0 = pending
    target = runner.collect(ticket).logits[0]
    drafts = draft.tokens if draft is not None else []
    if sampling.greedy:
        verdict = accept_greedy(target, drafts)
    else:
        verdict = accept_sampled(target, draft.logits if draft is not None else None, drafts, sampling,
                                 sampling.generator(st.stream ^ ACCEPT_SALT, st.step))
    keep = start + 1 + verdict.accepted
    if keep < start + 1 + len(drafts):
        runner.rollback(st.session, keep)  # a pipeline holds it back: it rides with the next step
    stats.verify_s += time.perf_counter() - t0
    stats.steps += 1
    stats.drafted += len(drafts)
    stats.accepted += verdict.accepted
    stats.emitted += verdict.accepted + 1
    st.tokens += drafts[:verdict.accepted] + [verdict.next_token]
    st.token, st.step = verdict.next_token, st.step + 1
    return st


def generate(runner, prompt_ids: list, max_new_tokens: int, sampling: Sampling, keep_sessions: bool,
             in_flight: int = 1) -> tuple[list, float]:
    """Prefill every prompt, then speculative steps with up to `in_flight` of them in flight, each
    session in at most one (its next block depends on this one's verdict); the tokens do not
    depend on `in_flight`. Returns (session, prompt ids, tokens) per prompt and the seconds taken."""
    runner.speculative_stats = stats = SpeculativeStats()
    streams: list[_Stream] = []
    t0 = time.perf_counter()
    with runner.deferred_session_ops():
        try:
            for i, ids in enumerate(prompt_ids):
                session = runner.open()
                streams.append(_Stream(session, i, -1, []))
                if max_new_tokens:
                    logits = runner.prefill(session, ids)
                    streams[-1].token = choose(logits, sampling, sampling.generator(i, 0))
                    streams[-1].tokens = [streams[-1].token]
            ready = collections.deque(st for st in streams if 0 < len(st.tokens) < max_new_tokens)
            flying: collections.deque = collections.deque()
            while ready or flying:
                while ready and len(flying) < in_flight:
                    flying.append(_submit(runner, ready.popleft(), max_new_tokens, sampling, stats))
                st = _finish(runner, flying.popleft(), sampling, stats)
                if len(st.tokens) < max_new_tokens:
                    ready.append(st)
        except BaseException:
            runner.abandon()
            raise
        finally:
            if not keep_sessions:
                for st in streams:
                    runner.close(st.session)
    return [(st.session, ids, st.tokens[:max_new_tokens]) for st, ids in zip(streams, prompt_ids)], \
        time.perf_counter() - t0
