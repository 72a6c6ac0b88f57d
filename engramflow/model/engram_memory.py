"""Engram memory for a set of layers: row addresses -> projected (key, value).

This is everything an Engram projection actor does, as a plain class: look the addressed rows
up in the host-resident tables (decoded straight into the projection's input layout), then
apply the layer's wkv projection.
"""
from __future__ import annotations

import numpy as np
import torch

from engramflow.errors import EngramflowError
from engramflow.kernels.projection import EngramProjection
from engramflow.memory.tables import EngramTable
from engramflow.model.checkpoint import Checkpoint


class EngramMemory:
    def __init__(self, ckpt: Checkpoint, layer_ids=None, threads: int | None = None, warmup: bool = False,
                 tiers: dict | None = None, numerics: str = "fast"):
        """`tiers`: per-layer storage config (engramflow.tiers.config); None = host mmap only.
        `numerics`: "official" for the v41 backbone (see EngramProjection)."""
        cfg = ckpt.config
        self.cfg = cfg
        self.layer_ids = tuple(cfg.engram_layer_ids if layer_ids is None else layer_ids)
        if tiers:
            from engramflow.tiers import SourceTable, build_sources

            sources = build_sources(tiers, ckpt)
            self.tables = {l: SourceTable(sources[l], l, cfg.engram_columns) for l in self.layer_ids}
        else:
            self.tables = {l: EngramTable(ckpt, l) for l in self.layer_ids}
        self.projections = {l: EngramProjection.from_checkpoint(ckpt.tensor, l, cfg, threads=threads,
                                                             numerics=numerics)
                            for l in self.layer_ids}
        if warmup:
            for t in self.tables.values():
                if hasattr(t, "warmup"):
                    t.warmup()

    def project(self, layer_id: int, addresses: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """addresses: int64 [T, n_engram_layers, columns] (all layers, as history returns them)
        or [T, columns] for this layer. Returns key [T, hc, dim], value [T, dim] (fp32)."""
        if layer_id not in self.tables:
            raise EngramflowError(f"this Engram memory holds layers {list(self.layer_ids)}, not {layer_id}")
        addresses = np.asarray(addresses)
        if addresses.ndim == 3:
            addresses = addresses[:, self.cfg.engram_layer_ids.index(layer_id)]
        x = self.tables[layer_id].lookup(addresses, torch.bfloat16)
        return self.projections[layer_id].project(x)

    def close(self) -> None:
        """Stop the projections' worker threads."""
        for p in self.projections.values():
            p.close()
