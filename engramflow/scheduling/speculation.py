"""Speculative decoding in the scheduler: which requests draft, and the Picked a sink
gets for each token of a verified block.

A request drafts when the runner was launched with `--speculative` and its token choice is the
runner's own `Pick` (greedy or temperature / top-k): then the verdict (pipeline/speculative.py)
draws exactly what `generate --speculative` draws for the same prompt and seed. A request with
`top_p` or `logit_bias` decodes plainly (the acceptance rule would need those applied to both
distributions), so its tokens stay those of plain decoding.
"""
from __future__ import annotations

import torch

from engramflow.model.sampling import Pick, Picked
from engramflow.pipeline.speculative import SessionSpeculation, SpeculativeStats


def speculation_for(runner, job, stats: SpeculativeStats) -> SessionSpeculation | None:
    """The job's speculative state once its session is open, or None when it decodes plainly."""
    if runner.speculative is None:
        return None
    pick = job.pick(0)
    if type(pick) is not Pick:  # top_p / logit_bias: BiasedPick (serve/picking.py)
        return None
    return SessionSpeculation(runner, job.session, pick.sampling, pick.stream, stats)


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
