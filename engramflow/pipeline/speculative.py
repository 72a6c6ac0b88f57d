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
ordinary step whose request carries the `Verify` pick.
"""
from __future__ import annotations

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


def decode(runner, session: str, token: int, max_new: int, sampling: Sampling, k: int, stream: int,
           stats: SpeculativeStats) -> list[int]:
    """Emit up to `max_new` tokens starting with `token` (chosen, not yet written)."""
    tokens, step = [token], 0
    while len(tokens) < max_new:
        n = min(k, max_new - len(tokens) - 1)  # never draft past what is asked for
        start = runner.length(session)
        t0 = time.perf_counter()
        draft = runner._draft(session, token, start, n, sampling, stream, step) if n else None
        t1 = time.perf_counter()
        drafts = draft.tokens if draft is not None else []
        target = verify(runner, session, [token] + drafts, start)
        if sampling.greedy:
            verdict = accept_greedy(target, drafts)
        else:
            verdict = accept_sampled(target, draft.logits if draft is not None else None, drafts, sampling,
                                     sampling.generator(stream ^ ACCEPT_SALT, step))
        keep = start + 1 + verdict.accepted
        if keep < start + 1 + len(drafts):
            runner.rollback(session, keep)  # held back by a pipeline: it rides with the next step
        stats.draft_s += t1 - t0
        stats.verify_s += time.perf_counter() - t1
        stats.steps += 1
        stats.draft_steps += bool(n)
        stats.drafted += len(drafts)
        stats.accepted += verdict.accepted
        stats.emitted += verdict.accepted + 1
        tokens += drafts[:verdict.accepted] + [verdict.next_token]
        token, step = verdict.next_token, step + 1
    return tokens[:max_new]


def generate(runner, prompt_ids: list, max_new_tokens: int, sampling: Sampling, keep_sessions: bool) -> list:
    """Each prompt in turn (speculation cuts the latency of one session at a time); returns
    (session, prompt ids, tokens) per prompt and the seconds the whole run took."""
    k = runner.speculative
    runner.speculative_stats = stats = SpeculativeStats()
    out = []
    t0 = time.perf_counter()
    with runner.deferred_session_ops():
        for stream, ids in enumerate(prompt_ids):
            session = runner.open()
            try:
                tokens = []
                if max_new_tokens:
                    logits = runner.prefill(session, ids)
                    first = choose(logits, sampling, sampling.generator(stream, 0))
                    tokens = decode(runner, session, first, max_new_tokens, sampling, k, stream, stats)
                out.append((session, ids, tokens))
            finally:
                if not keep_sessions:
                    runner.close(session)
    return out, time.perf_counter() - t0
