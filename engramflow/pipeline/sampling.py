"""Next-token choice: greedy, or seeded temperature / top-k sampling.

Accepted values (checked when a `Sampling` is made, so a bad one fails before any work):
temperature a finite number >= 0 (0 = greedy; any positive value, however small, samples:
the logits are shifted by their maximum before they are divided, so a tiny temperature
approaches greedy smoothly instead of overflowing), top_k an integer >= 0 (0 = the whole
vocabulary) and seed an integer in [0, SEED_MAX].
"""
from __future__ import annotations

import dataclasses
import math

import torch

from engramflow.errors import SEED_MAX, EngramflowError, check_seed  # noqa: F401 (re-exported)

_STREAM_MIX = 1_000_003  # seed * _STREAM_MIX + stream stays far below 2**63 for every valid seed


@dataclasses.dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = whole vocabulary
    seed: int = 0

    def __post_init__(self):
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise EngramflowError(f"temperature must be >= 0 and finite, got {t!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise EngramflowError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        check_seed(self.seed)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def generator(self, stream: int) -> torch.Generator | None:
        """One generator per session stream, so results do not depend on batching."""
        if self.greedy:
            return None
        return torch.Generator().manual_seed((self.seed * _STREAM_MIX + stream) % 2**64)


def choose(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> int:
    """Pick the next token from fp32 logits [V]."""
    if sampling.greedy:
        return int(torch.argmax(logits))
    logits = logits.double()
    # shift first: the largest scaled logit is exactly 0 and the rest <= 0, so no temperature
    # (down to the smallest subnormal) overflows to inf and softmax never sees inf - inf
    scaled = (logits - logits.max()) / sampling.temperature
    if sampling.top_k:
        kth = torch.topk(scaled, min(sampling.top_k, scaled.numel())).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))
