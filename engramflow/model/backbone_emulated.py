"""The `emulated` backbone: no weights, each block takes `block_ms`; Engram stays real (docs/architecture.md, "Backbones").

For overlap and timing measurements at real V4.1 size on CPUs. A block *sleeps* its time, as a
GPU kernel would leave the host CPU free for the projection threads. Block times are chained
deadlines — block i ends block_ms after max(previous deadline, the moment its Engram K/V
arrived) — so sleep overshoot does not pile up over 40 blocks, and a late K/V costs exactly its
overshoot, as in the timing model (docs/architecture.md). The Engram gate runs inside its block's time.
A block's time is per forward, whatever its sessions and tokens: a GPU runs a step's batch in
one launch per kernel, and at decode sizes the weights' read time, not the rows, sets it.

Hidden state, cheap at any size (nothing vocab×dim is ever allocated):
  * first stage: h[t] = cos(id·φ)·A + sin(id·φ)·B with fixed seeded A, B [hc, dim], so every
    token id gets its own O(1) direction;
  * each Engram block gates that layer's value into h exactly as the real model would;
  * other blocks leave h unchanged.
Last stage: proxy logits [T, 256] = rmsnorm(mean over streams of h) @ P (P seeded [dim, 256]),
and `tokens` maps the argmax through a seeded table of 256 distinct real token ids;
`next_logits` puts the last position's proxy scores at those ids (−inf elsewhere). So the next token
depends on the Engram values (a wrong row address changes the continuation) but it is not a
language model. The table avoids the lowest ids (BOS/EOS/pad) and the top tenth of the
vocabulary, where DeepSeek keeps its special tokens.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping

import torch

from engramflow.validate import check_number
from engramflow.kernels.gating import EngramGate
from engramflow.model.backbone_base import (BackboneStage, Segment, StageOutput, StageState, rmsnorm,
                                            seeded_generator)
from engramflow.io.config import ModelConfig
from engramflow.model.kv_cache import KVCache

N_PROXY = 256
_PHI = (math.sqrt(5) - 1) / 2  # irrational step: token ids map to well-spread angles
GateWeights = Callable[[str], torch.Tensor] | Mapping[str, torch.Tensor]


class EmulatedBackbone(BackboneStage):
    def __init__(self, cfg: ModelConfig, gate_weights: GateWeights | None, blocks: range, block_ms: float,
                 first: bool | None = None, last: bool | None = None, device: str | torch.device = "cpu",
                 seed: int = 0, numerics: str | None = None):
        # a cache without layers: sessions and lengths only, same semantics as the reference
        super().__init__(cfg, blocks, first, last, KVCache(0, 0, 0, cfg.max_seq_len, device), device, numerics)
        self.block_s = check_number("block_ms", block_ms, 0) / 1e3
        hc, dim = cfg.hc_mult, cfg.dim
        lookup = gate_weights.__getitem__ if isinstance(gate_weights, Mapping) else gate_weights

        def gate_weight(layer: int, key: str) -> torch.Tensor:
            if lookup is None:
                return torch.ones(hc, dim)
            return lookup(f"layers.{layer}.engram.{key}").float()

        self.gates = {layer: EngramGate(gate_weight(layer, "q_weight"), gate_weight(layer, "k_weight"),
                                        eps=cfg.norm_eps).to(self.device)
                      for layer in self.engram_layers}
        if self.first:
            self.embed_a = torch.randn(hc, dim, generator=seeded_generator(seed, "emulated.embed_a")).to(self.device)
            self.embed_b = torch.randn(hc, dim, generator=seeded_generator(seed, "emulated.embed_b")).to(self.device)
        if self.last:
            proj = torch.randn(dim, N_PROXY, generator=seeded_generator(seed, "emulated.proxy"))
            self.proxy = (proj * dim ** -0.5).to(self.device)
            high = max(4, cfg.vocab_size * 9 // 10)
            low = min(3, high - 1)
            ids = torch.randperm(high - low, generator=seeded_generator(seed, "emulated.proxy_ids"))[:N_PROXY] + low
            self.proxy_ids = ids.to(self.device)  # distinct real token ids

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        angle = (ids.to(torch.float64) * _PHI * 2 * math.pi).to(torch.float32)[:, None, None]
        return angle.cos() * self.embed_a + angle.sin() * self.embed_b

    def _enter(self, segments: list[Segment], xs: list) -> StageState:
        h = torch.cat([self._embed(x) for x in xs]) if self.first else torch.cat(xs)
        return StageState(segments, h, {"deadline": time.perf_counter()})

    def _run_block(self, block: int, state: StageState, started_s: float, wait_ms: float) -> None:
        # a block starts at the previous deadline, or when its K/V arrived if that was later;
        # a plain block never restarts the chain, so sleep overshoot does not accumulate
        deadline = state.extra["deadline"]
        arrived = started_s + wait_ms / 1e3 if wait_ms else deadline
        deadline = max(deadline, arrived) + self.block_s
        remaining = deadline - time.perf_counter()
        if remaining > 0:
            time.sleep(remaining)
        state.extra["deadline"] = deadline

    def _predict(self, state: StageState, outs: list[StageOutput]) -> None:
        for s, out in zip(state.segments, outs):
            rows = state.h[s.a:s.b] if s.verify else state.h[s.b - 1:s.b]  # verify: every position
            out.logits = rmsnorm(rows.mean(dim=1), None, self.cfg.norm_eps) @ self.proxy
            out.tokens = self.proxy_ids[out.logits.argmax(dim=-1)]
            # vocabulary-sized logits for the sampler: the proxy scores at their token ids
            out.next_logits = torch.full((rows.shape[0], self.cfg.vocab_size), float("-inf"), device=self.device)
            out.next_logits[:, self.proxy_ids] = out.logits
            if not s.verify:
                out.logits, out.next_logits = out.logits[-1:], out.next_logits[0]
