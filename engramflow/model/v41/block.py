"""One V4.1 block with hyper-connections (docs/v41.md, "Hyper-connections").

The collapse weights a sublayer's mix produces are used one step later: attention reads the
stream collapsed with `pre` from the previous block's MoE side, the MoE reads it collapsed with
this block's attention-side `pre`, and the MoE side's `pre` goes on to the next block.
"""
from __future__ import annotations

import torch

from engramflow.model.v41.attention import Attention
from engramflow.model.v41.hc import HyperMix, collapse, expand
from engramflow.model.v41.moe import MoE
from engramflow.model.v41.ops import rms_norm


class Block:
    def __init__(self, layer: int, attn: Attention, moe: MoE, attn_mix: HyperMix, ffn_mix: HyperMix,
                 attn_norm: torch.Tensor, ffn_norm: torch.Tensor, eps: float):
        self.layer, self.attn, self.moe = layer, attn, moe
        self.attn_mix, self.ffn_mix = attn_mix, ffn_mix
        self.attn_norm, self.ffn_norm, self.eps = attn_norm, ffn_norm, eps

    def __call__(self, h: torch.Tensor, pre: torch.Tensor, segments,
                 image_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """h [rows, hc, dim] bf16, pre [rows, hc] fp32 of the segments' rows -> (h, the next
        collapse weights). image_mask: bool [rows], image-span positions (routed with bias_vl)."""
        attn_pre, attn_post, attn_comb = self.attn_mix(h)
        a = rms_norm(collapse(h, pre), self.attn_norm, self.eps)
        h = expand(self.attn(a, segments), h, attn_post, attn_comb)
        ffn_pre, ffn_post, ffn_comb = self.ffn_mix(h)
        f = rms_norm(collapse(h, attn_pre), self.ffn_norm, self.eps)
        return expand(self.moe(f, image_mask), h, ffn_post, ffn_comb), ffn_pre
