"""The vision tower: a ViT over one image's patches, then the 3x3 aligner into the text model's width.

ViT (bf16 weights, fp32 norm weights):
    x = patch_embed(patches flattened)                              [n, vdim]
    per block:  x += wo(attention(rope2d(q), rope2d(k), v))  over norm1(x), all patches see all
                x += w2(silu(gate) * up), (gate, up) = w1(norm2(x))
    x = norm(x)        (RMSNorm eps 1e-6, computed in fp32, cast back to bf16)
2-D RoPE: each head's dims split in two halves (x1, x2) rotated as pairs (x1_i, x2_i); of the
head_dim/2 angles, the first half turn with the patch's row, the second half with its column,
at frequencies theta^(-2i/(head_dim/2)).
Aligner: the [vit_h, vit_w] grid is zero-padded to multiples of 3 and cut into 3x3 cells in reading
order; each cell's 9 vectors (channel-major: channel, then row, then column inside the cell) go
through w2(gelu(w1(.))) to one text-width row.
"""
from __future__ import annotations

import dataclasses
import functools

import torch
import torch.nn.functional as F

from engramflow.model.v41.vision.config import VisionConfig

EPS = 1e-6


@dataclasses.dataclass
class ViTBlock:
    norm1: torch.Tensor
    wqkv: tuple[torch.Tensor, torch.Tensor]
    wo: tuple[torch.Tensor, torch.Tensor]
    norm2: torch.Tensor
    w1: torch.Tensor
    w2: torch.Tensor


@dataclasses.dataclass
class TowerWeights:
    patch_embed: tuple[torch.Tensor, torch.Tensor]
    blocks: list[ViTBlock]
    norm: torch.Tensor
    aligner_w1: tuple[torch.Tensor, torch.Tensor]
    aligner_w2: tuple[torch.Tensor, torch.Tensor]


def rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    y = x.float()
    y = y * torch.rsqrt(y.square().mean(-1, keepdim=True) + EPS)
    return (weight * y).to(x.dtype)


@functools.lru_cache(16)
def rope_angles(vit_h: int, vit_w: int, rope_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [n, 1, rope_dim] fp32: per patch, rope_dim/2 row angles then rope_dim/2 column angles."""
    inv = 1.0 / (theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim))
    rows = torch.arange(vit_h).repeat_interleave(vit_w)
    cols = torch.arange(vit_w).repeat(vit_h)
    pos = torch.stack([rows, cols], dim=-1).float().unsqueeze(-1)  # [n, 2, 1]
    angles = (pos * inv).flatten(1)
    return angles.cos().unsqueeze(1), angles.sin().unsqueeze(1)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    a, b = x.float().chunk(2, dim=-1)
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1).to(x.dtype)


def _attention(x: torch.Tensor, blk: ViTBlock, heads: int, cos, sin) -> torch.Tensor:
    n = x.shape[0]
    q, k, v = (t.view(n, heads, -1) for t in F.linear(x, *blk.wqkv).chunk(3, dim=-1))
    q, k = rotate(q, cos, sin), rotate(k, cos, sin)
    o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1))
    return F.linear(o.transpose(0, 1).reshape(n, -1), *blk.wo)


def _mlp(x: torch.Tensor, blk: ViTBlock) -> torch.Tensor:
    gate, up = F.linear(x, blk.w1).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, blk.w2)


class VisionTower:
    def __init__(self, cfg: VisionConfig, weights: TowerWeights):
        self.cfg, self.w = cfg, weights

    @torch.inference_mode()
    def vit(self, patches: torch.Tensor, vit_h: int, vit_w: int) -> torch.Tensor:
        """patches bf16 [vit_h*vit_w, 3, p, p] -> [vit_h*vit_w, vision_dim] bf16."""
        cfg = self.cfg
        x = F.linear(patches.flatten(1), *self.w.patch_embed)
        cos, sin = rope_angles(vit_h, vit_w, cfg.head_dim // 2, cfg.rope_theta)
        for blk in self.w.blocks:
            x = x + _attention(rms_norm(x, blk.norm1), blk, cfg.n_heads, cos, sin)
            x = x + _mlp(rms_norm(x, blk.norm2), blk)
        return rms_norm(x, self.w.norm)

    @torch.inference_mode()
    def align(self, x: torch.Tensor, vit_h: int, vit_w: int) -> torch.Tensor:
        """ViT output [vit_h*vit_w, vdim] -> aligner rows [ceil(vit_h/r)*ceil(vit_w/r), text dim] bf16."""
        r = self.cfg.downsample_ratio
        grid = F.pad(x.view(vit_h, vit_w, -1).permute(2, 0, 1), (0, -vit_w % r, 0, -vit_h % r))
        cells = F.unfold(grid.unsqueeze(0), r, stride=r).squeeze(0).transpose(0, 1)
        return F.linear(F.gelu(F.linear(cells, *self.w.aligner_w1)), *self.w.aligner_w2)

    def encode(self, patches: torch.Tensor, vit_h: int, vit_w: int) -> torch.Tensor:
        return self.align(self.vit(patches, vit_h, vit_w), vit_h, vit_w)
