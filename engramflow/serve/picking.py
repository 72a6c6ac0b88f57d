"""The last stage's token choice for a served request: the runner's `Pick` (so a request's
tokens equal `generate` for the same prompt and seed), extended by OpenAI's `top_p` and
`logit_bias` when a request sets them.

Order of operations: bias the logits, then temperature, top-k, top-p (the smallest set of
most likely tokens whose probability reaches top_p), then draw with the counter-based
generator of (seed, stream, step). Log-probabilities are those of the biased logits.
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from engramflow.model.sampling import Pick, Picked, Sampling


@dataclasses.dataclass(frozen=True)
class BiasedPick:
    verifies: ClassVar[bool] = False
    sampling: Sampling
    stream: int = 0
    step: int = 0
    logprobs: int = 0
    top_p: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __call__(self, logits: torch.Tensor) -> Picked:
        logits = logits.float().clone()
        if self.logit_bias:
            ids = torch.tensor([i for i, _ in self.logit_bias])
            logits[ids] += torch.tensor([b for _, b in self.logit_bias], dtype=logits.dtype)
        token = self._choose(logits)
        if not self.logprobs:
            return Picked(token)
        lp = torch.log_softmax(logits, dim=-1)
        top = torch.topk(lp, min(self.logprobs, lp.numel()))
        return Picked(token, float(lp[token]), tuple(top.indices.tolist()), tuple(top.values.tolist()))

    def _choose(self, logits: torch.Tensor) -> int:
        if self.sampling.greedy:
            return int(torch.argmax(logits))
        scaled = (logits.double() - logits.max()) / self.sampling.temperature
        if self.sampling.top_k:
            kth = torch.topk(scaled, min(self.sampling.top_k, scaled.numel())).values[-1]
            scaled = scaled.masked_fill(scaled < kth, float("-inf"))
        probs = torch.softmax(scaled, dim=-1)
        if self.top_p < 1.0:
            sorted_p, order = torch.sort(probs, descending=True)
            before = torch.cumsum(sorted_p, 0) - sorted_p  # mass of the more likely tokens
            sorted_p[before >= self.top_p] = 0.0  # the first token always stays
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
        return int(torch.multinomial(probs, 1, generator=self.sampling.generator(self.stream, self.step)))


def pick_factory(sampling: Sampling, logprobs: int = 0, top_p: float = 1.0, logit_bias: dict | None = None,
                 stream: int = 0):
    """step -> what the last stage runs for token `step` of a request (stream 0, as a lone
    prompt of `generate`; choice i of n > 1 draws from its own stream)."""
    bias = tuple(sorted((int(k), float(v)) for k, v in (logit_bias or {}).items()))
    if top_p >= 1.0 and not bias:
        return lambda step: Pick(sampling, stream, step, logprobs)
    return lambda step: BiasedPick(sampling, stream, step, logprobs, top_p, bias)
