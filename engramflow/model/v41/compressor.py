"""Compressed KV of a KV-source layer (docs/v41.md, "Attention").

Ratio 1: one latent per token, norm(wkv(x)) with a bf16 wkv. Ratio r > 1: per channel, a
softmax over the r tokens of a group of the gate logits wgate(x) weights their wkv(x) (both fp32
linears on fp32 x); the pooled group is rounded to bf16 and normed. A group's latent appears
when its last token does, whichever forward brings it: the carry buffers hold each position's
kv and logits, so a group split across a prefill chunk or decode steps pools the same numbers.

The unrotated latent feeds the index keys; the cache gets it rotated at the group's first
position and FP4-QDQ'd in groups of 16 with E4M3 scales.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engramflow.kernels import rowwise
from engramflow.kernels.quant import fp4_qdq
from engramflow.model.v41.ops import linear, rms_norm
from engramflow.model.v41.rope import Rotary


@dataclass
class CompressorWeights:
    wkv: torch.Tensor            # [head_dim, dim]: bf16 (ratio 1) or fp32 (ratio > 1)
    wgate: torch.Tensor | None   # [head_dim, dim] fp32, ratio > 1 only
    norm: torch.Tensor           # [head_dim] bf16


class Compressor:
    def __init__(self, layer: int, ratio: int, w: CompressorWeights, rotary: Rotary, eps: float):
        self.layer, self.ratio, self.w, self.rotary, self.eps = layer, ratio, w, rotary, eps
        self.carry_kv, self.carry_score = f"carry_kv.{layer}", f"carry_score.{layer}"
        self.rows = f"compressed.{layer}"

    def latents(self, x: torch.Tensor, segments) -> list[tuple[int, torch.Tensor]]:
        """Per segment, the groups its positions complete: (first group index, latents [n, head_dim]
        bf16). The linears take every row of the forward at once."""
        r = self.ratio
        if r == 1:
            lat = rms_norm(linear(x, self.w.wkv), self.w.norm, self.eps)
            return [(s.start, lat[s.a:s.b]) for s in segments]
        xf = x.float()
        kv_rows, score_rows = linear(xf, self.w.wkv), linear(xf, self.w.wgate)
        out = []
        for s in segments:
            kv_buf, score_buf = s.extra["buffers"](self.carry_kv), s.extra["buffers"](self.carry_score)
            kv_buf[s.start:s.end] = kv_rows[s.a:s.b]
            score_buf[s.start:s.end] = score_rows[s.a:s.b]
            g0, g1 = s.start // r, s.end // r
            kv = kv_buf[g0 * r:g1 * r].unflatten(0, (-1, r))
            score = score_buf[g0 * r:g1 * r].unflatten(0, (-1, r))
            pooled = (kv * rowwise.softmax(score, dim=1)).sum(dim=1)
            out.append((g0, rms_norm(pooled.to(x.dtype), self.w.norm, self.eps)))
        return out

    def store(self, latents: list[tuple[int, torch.Tensor]], segments) -> None:
        """Rotate at each group's first position, FP4-QDQ, write rows g0.. of each session's compressed cache."""
        for (g0, latent), s in zip(latents, segments):
            if latent.shape[0] == 0:
                continue
            pos = torch.arange(g0, g0 + latent.shape[0], device=latent.device) * self.ratio
            rows = fp4_qdq(self.rotary.rotate(latent, pos), 16, e4m3_scale=True)
            s.extra["buffers"](self.rows)[g0:g0 + rows.shape[0]] = rows
