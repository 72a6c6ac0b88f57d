"""Which drafted tokens a verified block keeps.

A step writes the block [t, d_1 .. d_k] in one forward and gets the target logits after each of
its positions, rows 0..k (row i: the distribution of the token after d_i, d_0 = t).

* Greedy: keep d_1 .. d_m while d_{i+1} is the argmax of row i; the next token is the argmax of
  row m. The output is exactly plain greedy decoding's (given the same rows).
* Sampling (temperature > 0): standard speculative sampling. Draft i was drawn from q_i (the
  draft layers' distribution given the drafts before it); keep it with probability
  min(1, p_i(d)/q_i(d)), p_i the target distribution of row i; at the first rejection draw the
  next token from max(p_i − q_i, 0) renormalised; when all k are kept, draw it from p_k. Each
  emitted token is then distributed exactly as plain sampling's.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engramflow.model.sampling import Sampling, probabilities

DRAFT_SALT, ACCEPT_SALT = 0x5EC0DE, 0xACCE97  # the draws' streams, apart from plain sampling's


class Verify:
    """A request's pick that makes the stages verify: the rows come back as decode steps', and
    the last stage returns every position's logits [T, vocab] instead of the last one's."""
    verifies = True

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        return logits


@dataclass
class Draft:
    """What the draft layers propose after a block's first token."""
    tokens: list[int]           # the drafted tokens, block_size of them (after the block's first token)
    logits: torch.Tensor        # fp32 [B, vocab]: the distribution each draft was chosen from (biases added)
    confidence: torch.Tensor    # fp32 [B]


def drafts_on_stage(stage, asks: list[tuple]) -> list[Draft]:
    """The last stage's drafts for several sessions in one forward of the draft layers; each ask
    is (session, token, start, n, sampling, stream, step): n drafts after `token` at position
    `start`, greedy, or drawn from the draft layers' rows with a generator of (seed, stream, step)."""
    return stage.draft_many([(session, token, start, _chooser(sampling, stream, step), n)
                             for session, token, start, n, sampling, stream, step in asks])


def _chooser(sampling: Sampling, stream: int, step: int):
    if sampling.greedy:
        return None
    gen = sampling.generator(stream ^ DRAFT_SALT, step)
    return lambda row, i: draw(row, sampling, gen)


@dataclass
class Verdict:
    accepted: int      # drafts kept (m)
    next_token: int    # the token after the kept ones (target's choice)


def accept_greedy(target: torch.Tensor, drafts: list[int]) -> Verdict:
    """target fp32 [k+1, V], drafts k tokens."""
    best = target.argmax(dim=-1).tolist()
    m = 0
    while m < len(drafts) and drafts[m] == best[m]:
        m += 1
    return Verdict(m, best[m])


def accept_sampled(target: torch.Tensor, draft_logits: torch.Tensor, drafts: list[int], sampling: Sampling,
                   generator: torch.Generator) -> Verdict:
    """target [k+1, V], draft_logits [k, V] (the rows the drafts were drawn from)."""
    for i, d in enumerate(drafts):
        p = probabilities(target[i], sampling)
        q = probabilities(draft_logits[i], sampling)
        u = float(torch.rand((), dtype=torch.float64, generator=generator))
        if u * float(q[d]) < float(p[d]):
            continue
        residual = (p - q).clamp_min(0)
        weights = residual if float(residual.sum()) > 0 else p
        return Verdict(i, int(torch.multinomial(weights, 1, generator=generator)))
    p = probabilities(target[len(drafts)], sampling)
    return Verdict(len(drafts), int(torch.multinomial(p, 1, generator=generator)))


def draw(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator) -> int:
    """A draft token drawn from the draft layers' row (the q of accept_sampled)."""
    return int(torch.multinomial(probabilities(logits, sampling), 1, generator=generator))
