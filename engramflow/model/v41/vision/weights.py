"""Read the vision tower and the span delimiters from a checkpoint in the released names
(`vision.*`, `aligner.*`, `image_start` / `image_end` / `image_newline`); names, shapes and
stored dtypes are checked against the model's tensor table (names.py)."""
from __future__ import annotations

import torch

from engramflow.io.checkpoint import Checkpoint
from engramflow.model.v41.config import v41_from_dict
from engramflow.model.v41.vision.config import VisionConfig
from engramflow.model.v41.vision.tower import TowerWeights, ViTBlock
from engramflow.model.v41.weights import WeightReader


def _reader(ckpt: Checkpoint, device) -> WeightReader:
    return WeightReader(ckpt, v41_from_dict(ckpt.raw_config), device)


def _linear(r: WeightReader, p: str, bias: bool = True):
    w = r.dense(f"{p}.weight")
    return (w, r.dense(f"{p}.bias")) if bias else w


def tower_weights(ckpt: Checkpoint, cfg: VisionConfig, device: str | torch.device = "cpu") -> TowerWeights:
    r = _reader(ckpt, device)
    blocks = []
    for i in range(cfg.n_layers):
        b = f"vision.blocks.{i}"
        blocks.append(ViTBlock(
            norm1=r.dense(f"{b}.norm1.weight", torch.float32),
            wqkv=_linear(r, f"{b}.attn.wqkv"), wo=_linear(r, f"{b}.attn.wo"),
            norm2=r.dense(f"{b}.norm2.weight", torch.float32),
            w1=_linear(r, f"{b}.mlp.w1", bias=False), w2=_linear(r, f"{b}.mlp.w2", bias=False)))
    return TowerWeights(
        patch_embed=_linear(r, "vision.patch_embed.proj"), blocks=blocks,
        norm=r.dense("vision.norm.weight", torch.float32),
        aligner_w1=_linear(r, "aligner.w1"), aligner_w2=_linear(r, "aligner.w2"))


def delimiter_weights(ckpt: Checkpoint, cfg: VisionConfig, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """START / END / NEW_LINE embeddings [text dim] bf16."""
    r = _reader(ckpt, device)
    return {name: r.dense(name) for name in ("image_start", "image_end", "image_newline")}
