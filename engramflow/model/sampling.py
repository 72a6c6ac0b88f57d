"""Next-token choice: greedy, or seeded temperature / top-k sampling; and `Pick`, what the last
stage hands back instead of the full-vocabulary logits when the caller only needs the token.

Accepted values (checked when a `Sampling` is made, so a bad one fails before any work):
temperature a finite number >= 0 (0 = greedy; any positive value, however small, samples:
the logits are shifted by their maximum before they are divided, so a tiny temperature
approaches greedy smoothly instead of overflowing), top_k an integer >= 0 (0 = the whole
vocabulary) and seed an integer in [0, SEED_MAX].

Randomness is counter-based: the draw for token `step` of session stream `stream` comes from
a generator seeded by (seed, stream, step) alone. So a token does not depend on which process
samples it (the driver, or the last stage of a pipeline), on how sessions are grouped into
steps, or on how many steps are in flight.
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar
import math

import torch

from engramflow.errors import SEED_MAX, EngramflowError, check_seed  # noqa: F401 (re-exported)

_M64 = 2**64 - 1


def _splitmix64(x: int) -> int:
    """One step of splitmix64: a cheap bijective mix, so nearby counters give unrelated seeds."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def stream_seed(seed: int, stream: int, step: int) -> int:
    return _splitmix64(_splitmix64(_splitmix64(seed) ^ (stream & _M64)) ^ (step & _M64))


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

    def generator(self, stream: int, step: int = 0) -> torch.Generator | None:
        """The generator of one draw: token `step` of session `stream` (None when greedy)."""
        if self.greedy:
            return None
        return torch.Generator().manual_seed(stream_seed(self.seed, stream, step))


def choose(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> int:
    """Pick the next token from fp32 logits [V]."""
    if sampling.greedy:
        return int(torch.argmax(logits))
    return int(torch.multinomial(probabilities(logits, sampling), 1, generator=generator))


def probabilities(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """float64 [V]: the distribution a sampled token is drawn from (temperature > 0)."""
    logits = logits.double()
    # shift first: the largest scaled logit is exactly 0 and the rest <= 0, so no temperature
    # (down to the smallest subnormal) overflows to inf and softmax never sees inf - inf
    scaled = (logits - logits.max()) / sampling.temperature
    if sampling.top_k:
        kth = torch.topk(scaled, min(sampling.top_k, scaled.numel())).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    return torch.softmax(scaled, dim=-1)


@dataclasses.dataclass(frozen=True)
class Picked:
    """What the caller needs of one position's logits: the chosen token, and (when asked) its
    log-probability and the top-k tokens with theirs. A few bytes instead of the vocabulary."""
    token: int
    logprob: float | None = None
    top_tokens: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()


@dataclasses.dataclass(frozen=True)
class Pick:
    """Ask the last stage for a token instead of the logits: draw `step` of stream `stream`
    under `sampling`; with `logprobs` > 0 also the chosen token's log-probability and the
    `logprobs` most likely tokens' (fp32 log_softmax)."""
    verifies: ClassVar[bool] = False  # every pick declares whether it makes the stages verify a block
    sampling: Sampling = Sampling()
    stream: int = 0
    step: int = 0
    logprobs: int = 0

    def __call__(self, logits: torch.Tensor) -> Picked:
        logits = logits.float()
        token = choose(logits, self.sampling, self.sampling.generator(self.stream, self.step))
        if not self.logprobs:
            return Picked(token)
        lp = torch.log_softmax(logits, dim=-1)
        top = torch.topk(lp, min(self.logprobs, lp.numel()))
        return Picked(token, float(lp[token]), tuple(top.indices.tolist()), tuple(top.values.tolist()))


def verifies(pick) -> bool:
    """Whether a write's pick makes the stages verify a drafted block (speculative.Verify): its
    rows run as decode steps' and every position's logits come back. No pick: a plain write."""
    return pick is not None and pick.verifies
