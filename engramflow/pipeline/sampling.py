"""Next-token choice: greedy, or seeded temperature / top-k sampling."""
from __future__ import annotations

import dataclasses

import torch

from engramflow.errors import EngramflowError


@dataclasses.dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = whole vocabulary
    seed: int = 0

    def __post_init__(self):
        if not self.temperature >= 0:
            raise EngramflowError(f"temperature must be >= 0, got {self.temperature!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise EngramflowError(f"top_k must be an integer >= 0, got {self.top_k!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def generator(self, stream: int) -> torch.Generator | None:
        """One generator per session stream, so results do not depend on batching."""
        return None if self.greedy else torch.Generator().manual_seed(self.seed * 1_000_003 + stream)


def choose(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> int:
    """Pick the next token from fp32 logits [V]."""
    if sampling.greedy:
        return int(torch.argmax(logits))
    scaled = logits.double() / sampling.temperature
    if sampling.top_k:
        kth = torch.topk(scaled, min(sampling.top_k, scaled.numel())).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))
