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

Steps in flight. A session's next block depends on its last verdict, so each session is one lane
of StepsInFlight (in_flight.py) with at most one step in flight; with several sessions, up to
`in_flight` of their steps are in flight at once (stage g verifies one session's block while
stage g+1 verifies another's), as plain decoding's groups are. A session's draft call queues behind the steps already on the last
stage (actors run calls in order) and reads only ring rows of positions < its start, so it needs
no held-back rollback to have arrived; the rollback rides with the next step's calls. Tokens do
not depend on `in_flight`: every draw is seeded by (seed, stream, step).
"""
from __future__ import annotations

import dataclasses
import time

import numpy as np
import torch

from engramflow.errors import EngramflowError
from engramflow.model.sampling import Pick, Sampling
from engramflow.model.speculative import ACCEPT_SALT, Verify, accept_greedy, accept_sampled
from engramflow.pipeline.in_flight import Lane


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

    def add(self, drafted: int, accepted: int, verify_s: float) -> None:
        """One verified step: `accepted` of its `drafted` tokens kept, plus the next token."""
        self.steps += 1
        self.drafted += drafted
        self.accepted += accepted
        self.emitted += accepted + 1
        self.verify_s += verify_s

    def as_dict(self) -> dict:
        return dataclasses.asdict(self) | {"acceptance": self.acceptance, "tokens_per_step": self.tokens_per_step}


def verify(runner, session: str, ids: list[int], start: int) -> torch.Tensor:
    """Write the block at `start` in one step through every stage; every position's logits [T, V]."""
    return runner._run([runner.request(session, np.asarray(ids, dtype=np.int64), start, pick=Verify())]).logits[0]


def session_lane(runner, m, max_new_tokens: int, sampling: Sampling, stats: SpeculativeStats) -> Lane:
    """One session's steps (a lane of StepsInFlight: each `yield` is a step, sent back its
    result): the prompt's chunks, then draft + verify until `m.tokens` holds max_new_tokens.
    `m` is a generation Member (stream, session, prompt_ids, tokens)."""
    first = Pick(sampling, m.stream, 0)  # the same draw plain decoding makes for token 0
    for chunk in runner.prefill_requests(m.session, m.prompt_ids, image_spans=m.image_spans, pick=first,
                                         images=m.images):
        result = yield [chunk]
    if not max_new_tokens:
        return
    token, step = result.logits[0].token, 0
    m.tokens.append(token)
    while len(m.tokens) < max_new_tokens:
        n = min(runner.speculative, max_new_tokens - len(m.tokens) - 1)  # never draft past what is asked for
        start = runner.length(m.session)
        t0 = time.perf_counter()
        draft = runner._draft(m.session, token, start, n, sampling, m.stream, step) if n else None
        stats.draft_s += time.perf_counter() - t0
        stats.draft_steps += bool(n)
        drafts = draft.tokens if draft is not None else []
        t1 = time.perf_counter()  # before the submit: an in-process runner computes the step in it
        result = yield [runner.request(m.session, [token] + drafts, start, pick=Verify())]
        target = result.logits[0]
        if sampling.greedy:
            verdict = accept_greedy(target, drafts)
        else:
            verdict = accept_sampled(target, draft.logits if draft is not None else None, drafts, sampling,
                                     sampling.generator(m.stream ^ ACCEPT_SALT, step))
        keep = start + 1 + verdict.accepted
        if keep < start + 1 + len(drafts):
            runner.rollback(m.session, keep)  # a pipeline holds it back: it rides with the next step
        stats.add(len(drafts), verdict.accepted, time.perf_counter() - t1)
        m.tokens += drafts[:verdict.accepted] + [verdict.next_token]
        token, step = verdict.next_token, step + 1
