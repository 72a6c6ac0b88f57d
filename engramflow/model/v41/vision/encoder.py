"""The vision side of a V4.1 checkpoint in one object: its limits, the tower, the delimiters.

`prepare` turns an image (bytes, path, PIL) into patches on the caller's side, where a bad image
is refused before anything else happens; `span_rows` runs the tower and lays out the span.
"""
from __future__ import annotations

import torch

from engramflow.errors import EngramflowError
from engramflow.io.checkpoint import Checkpoint
from engramflow.model.v41.vision.config import VisionConfig, vision_from_dict
from engramflow.model.v41.vision.preprocess import PreparedImage
from engramflow.model.v41.vision.sources import prepare_any
from engramflow.model.v41.vision.spans import span_rows
from engramflow.model.v41.vision.tower import VisionTower
from engramflow.model.v41.vision.weights import delimiter_weights, tower_weights


def vision_config(ckpt: Checkpoint) -> VisionConfig:
    raw = ckpt.raw_config
    return vision_from_dict(raw, int(raw.get("dim", raw.get("hidden_size", 0)) or ckpt.config.dim))


def has_vision(ckpt: Checkpoint) -> bool:
    return vision_config(ckpt).enabled


def require_vision(cfg: VisionConfig) -> None:
    if not cfg.enabled:
        raise EngramflowError("this checkpoint has no vision tower (vision_n_layers is 0): it takes no images")


class VisionEncoder:
    def __init__(self, ckpt: Checkpoint, device: str | torch.device = "cpu"):
        self.cfg = vision_config(ckpt)
        require_vision(self.cfg)
        self.tower = VisionTower(self.cfg, tower_weights(ckpt, self.cfg, device))
        self.delimiters = delimiter_weights(ckpt, self.cfg, device)
        self.device = torch.device(device)

    def prepare(self, image, label: str = "") -> PreparedImage:
        return prepare_any(image, self.cfg, label)

    def span_rows(self, image: PreparedImage) -> torch.Tensor:
        """The rows of the image's whole span [span_tokens, text dim] bf16, on the CPU."""
        g = image.grid
        features = self.tower.encode(image.patches.to(self.device), g.vit_h, g.vit_w)
        return span_rows(features, g.llm_h, g.llm_w, self.delimiters).cpu()
