"""Read the vision tower and the span delimiters from a checkpoint in the released names
(`vision.*`, `aligner.*`, `image_start` / `image_end` / `image_newline`), shapes checked."""
from __future__ import annotations

import torch

from engramflow.io.checkpoint import Checkpoint
from engramflow.model.v41.vision.config import VisionConfig
from engramflow.model.v41.vision.tower import TowerWeights, ViTBlock
from engramflow.model.v41.weights import WeightReader


def _linear(r: WeightReader, p: str, out_f: int, in_f: int, bias: bool = True):
    w = r.dense(f"{p}.weight", (out_f, in_f))
    return (w, r.dense(f"{p}.bias", (out_f,))) if bias else w


def tower_weights(ckpt: Checkpoint, cfg: VisionConfig, device: str | torch.device = "cpu") -> TowerWeights:
    r = WeightReader(ckpt, device)
    d, inter, p = cfg.dim, cfg.inter_dim, cfg.patch_size
    blocks = []
    for i in range(cfg.n_layers):
        b = f"vision.blocks.{i}"
        blocks.append(ViTBlock(
            norm1=r.dense(f"{b}.norm1.weight", (d,), torch.float32),
            wqkv=_linear(r, f"{b}.attn.wqkv", 3 * d, d), wo=_linear(r, f"{b}.attn.wo", d, d),
            norm2=r.dense(f"{b}.norm2.weight", (d,), torch.float32),
            w1=_linear(r, f"{b}.mlp.w1", 2 * inter, d, bias=False), w2=_linear(r, f"{b}.mlp.w2", d, inter, bias=False)))
    down = cfg.downsample_ratio
    return TowerWeights(
        patch_embed=_linear(r, "vision.patch_embed.proj", d, 3 * p * p), blocks=blocks,
        norm=r.dense("vision.norm.weight", (d,), torch.float32),
        aligner_w1=_linear(r, "aligner.w1", cfg.text_dim, d * down * down),
        aligner_w2=_linear(r, "aligner.w2", cfg.text_dim, cfg.text_dim))


def delimiter_weights(ckpt: Checkpoint, cfg: VisionConfig, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """START / END / NEW_LINE embeddings [text dim] bf16."""
    r = WeightReader(ckpt, device)
    return {name: r.dense(name, (cfg.text_dim,)) for name in ("image_start", "image_end", "image_newline")}
