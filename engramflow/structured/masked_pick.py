"""A token choice under a grammar: the request's own pick, on logits where every token the
grammar does not allow next is -inf.

It runs where tokens are picked (the last stage, or the driver in process), so it imports only
torch: the bitmask travels with the step's request (xgrammar's packed int32 words, bit j of
word i = token 32*i + j allowed; 16 KB for a 129k-token vocabulary). Masking comes first, so the
request's temperature, top-k, top-p and logit_bias act on the allowed tokens only, and its
log-probabilities are those of the masked logits (as vLLM reports them).
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch

_BITS = torch.arange(32, dtype=torch.int32)


def allowed_tokens(bitmask: np.ndarray, vocab: int) -> torch.Tensor:
    """bool [vocab]: the tokens the packed bitmask allows."""
    words = torch.from_numpy(np.ascontiguousarray(bitmask, dtype=np.int32))
    return ((words[:, None] >> _BITS) & 1).bool().reshape(-1)[:vocab]


def mask_logits(logits: torch.Tensor, bitmask: np.ndarray) -> torch.Tensor:
    """fp32 [V] logits with the disallowed tokens at -inf (a copy)."""
    logits = logits.float()
    allowed = allowed_tokens(bitmask, logits.numel())
    if allowed.numel() < logits.numel():  # logits wider than the mask: the rest is not allowed
        allowed = torch.cat([allowed, torch.zeros(logits.numel() - allowed.numel(), dtype=torch.bool)])
    return torch.where(allowed, logits, float("-inf"))


@dataclasses.dataclass(frozen=True, eq=False)
class MaskedPick:
    pick: object  # the request's own Pick-like callable
    bitmask: np.ndarray  # int32 words
    verifies = False  # one token, as a plain decode's pick (not a speculative block's verdict)

    @property
    def logprobs(self) -> int:
        return self.pick.logprobs

    def __call__(self, logits: torch.Tensor):
        picked = self.pick(mask_logits(logits, self.bitmask))
        if not picked.top_tokens or math.isfinite(picked.top_logprobs[-1]):
            return picked
        # fewer tokens allowed than top_logprobs asked for: the rest are -inf, which is no JSON number
        kept = [(t, lp) for t, lp in zip(picked.top_tokens, picked.top_logprobs) if math.isfinite(lp)]
        return dataclasses.replace(picked, top_tokens=tuple(t for t, _ in kept),
                                   top_logprobs=tuple(lp for _, lp in kept))
