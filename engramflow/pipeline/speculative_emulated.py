"""Speculative decoding's speed where random weights accept nothing: injected acceptance on the
emulated backbone, and the timing model it is checked against.

The emulated backbone's block time does not depend on the tokens in a forward (a GPU's at
batch 1), so verifying k+1 tokens costs one decode step. The drafter stands in for the draft
layers: it knows the plain greedy continuation (from a plain run) and drafts each next token
right with probability `acceptance`, independently, wrong otherwise; each draft costs
`draft_ms` (the draft layers: a few blocks' time).

Timing model. With per-draft acceptance a and k drafts, a step emits the kept prefix plus one
token: E = 1 + a + ... + a^k = (1 − a^{k+1}) / (1 − a). A step costs one draft and one
verification (≈ a plain decode step), so
    tokens/s = E / (draft_s + verify_s),    plain tokens/s = 1 / verify_s
(steady state; `model_tokens_per_s(..., new_tokens)` takes a finite generation's shorter last steps).

For the adaptive mode (speculative.ConfidenceGate) the drafter also needs what makes a gate
useful: text with easy and hard stretches (`hard`: the per-draft acceptance in hard stretches,
`switch`: the chance per token that a stretch ends) and a confidence that says whether a draft
is right (its logit drawn from N(+CONFIDENCE_SHIFT, 1) when right, N(-CONFIDENCE_SHIFT, 1) when
wrong). Whether a draft is right is a property of (stream, position, index in the block), drawn
from a counter-seeded generator, so runs with and without the gate see the same text.
"""
from __future__ import annotations

import time

import numpy as np
import torch

from engramflow.model.speculative import Draft
from engramflow.pipeline.engine import Engine
from engramflow.pipeline.runner import Runner


def tokens_per_step(acceptance: float, k: int) -> float:
    return float(sum(acceptance ** i for i in range(k + 1)))


def model_tokens_per_s(acceptance: float, k: int, draft_s: float, verify_s: float, new_tokens: int = 0) -> float:
    """The model's decode tokens/s; with `new_tokens`, for a generation of that many tokens (its
    last steps draft fewer: never past what is asked for), else the steady state."""
    if not new_tokens:
        return tokens_per_step(acceptance, k) / (draft_s + verify_s)
    time_left = [0.0] * new_tokens  # expected seconds to emit r more tokens
    for r in range(1, new_tokens):
        n = min(k, r - 1)
        t = (draft_s if n else 0.0) + verify_s
        for m in range(n + 1):
            p = acceptance ** m * ((1 - acceptance) if m < n else 1.0)
            t += p * time_left[r - m - 1]
        time_left[r] = t
    return (new_tokens - 1) / time_left[new_tokens - 1]


CONFIDENCE_SHIFT = 1.5


class InjectedAcceptanceEngine(Engine):
    """An Engine on the emulated backbone whose drafts are right with probability `acceptance`
    (`hard` in hard stretches of the text, when given); `threshold`: the adaptive gate."""

    def __init__(self, checkpoint, k: int, acceptance: float, draft_ms: float, block_ms: float = 1.0,
                 seed: int = 0, hard: float | None = None, switch: float = 0.0, threshold: float | None = None):
        super().__init__(checkpoint, backbone="emulated", block_ms=block_ms)
        self.speculative, self.acceptance, self.draft_s = k, acceptance, draft_ms / 1e3
        self.speculative_gate = threshold
        self.hard, self.switch, self.seed = hard, switch, seed
        self.reference: dict[int, list[int]] = {}  # stream -> plain continuation
        self.hard_at: dict[int, np.ndarray] = {}  # stream -> whether each token is in a hard stretch
        self.right = self.made = 0  # drafts made right / made: the realized acceptance rate

    drafts = Runner.drafts  # one session at a time, through _draft below

    def _draft(self, session, token, start, n, sampling, stream, step) -> Draft:
        t_end = time.perf_counter() + self.draft_s
        ref = self.reference[stream]
        j = start - self.prompt_lengths[stream]  # `token` is ref[j]
        tokens, confidence = [], []
        for i in range(n):
            p = min(j + 1 + i, len(ref) - 1)
            rng = np.random.default_rng([self.seed, stream, p, i])  # the text's, whoever drafts
            rate = self.hard if self.hard is not None and self.hard_at[stream][p] else self.acceptance
            keep = rng.random() < rate
            tokens.append(ref[p] if keep else (ref[p] + 1) % self.cfg.vocab_size)
            confidence.append(rng.normal(CONFIDENCE_SHIFT if keep else -CONFIDENCE_SHIFT, 1.0))
            self.right, self.made = self.right + keep, self.made + 1
        while time.perf_counter() < t_end:  # the draft layers' time (sleep overshoots at ms scale)
            time.sleep(min(1e-3, max(0.0, t_end - time.perf_counter())))
        return Draft(tokens, torch.zeros(n, 1), torch.tensor(confidence, dtype=torch.float32))

    def plant(self, prompts: list[list[int]], continuations: list[list[int]]) -> None:
        """The plain run's tokens, per prompt (stream = the prompt's index in generate)."""
        self.prompt_lengths = [len(p) for p in prompts]
        self.reference = dict(enumerate(continuations))
        for stream, ref in self.reference.items():  # easy / hard stretches: a two-state Markov chain
            rng = np.random.default_rng([self.seed, stream, 1 << 20])
            flips = rng.random(len(ref)) < self.switch
            self.hard_at[stream] = (np.cumsum(flips) + rng.integers(2)) % 2 == 1
