"""Engram memory for a set of layers: row addresses -> projected (key, value).

This is everything an Engram projection actor does, as a plain class: look the addressed rows
up in each layer's row store (decoded straight into the projection's input layout), then apply
the layer's wkv projection. The store is the plain host table, or the storage tiers when
configured; both are `engramflow.tiers.RowStore`s with the same lookup.
"""
from __future__ import annotations

import numpy as np
import torch

from engramflow.errors import EngramflowError
from engramflow.kernels.projection import EngramProjection
from engramflow.io.checkpoint import Checkpoint
from engramflow.model.engram_rows import EngramRows
from engramflow.tiers.config import TiersConfig, build_stores


class EngramMemory:
    def __init__(self, ckpt: Checkpoint, layer_ids=None, threads: int | None = None, warmup: bool = False,
                 tiers: TiersConfig | dict | None = None, numerics: str = "fast"):
        """`tiers`: per-layer storage (a TiersConfig from engramflow.tiers.parse_tiers, or its dict
        form); None = the host mmap tables. `numerics`: "official" for the v41 backbone (see
        EngramProjection)."""
        cfg = ckpt.config
        self.cfg = cfg
        self.layer_ids = tuple(cfg.engram_layer_ids if layer_ids is None else layer_ids)
        self.tables = build_stores(tiers, ckpt, self.layer_ids)
        self.projections = {l: EngramProjection.from_checkpoint(ckpt.tensor, l, cfg, threads=threads,
                                                             numerics=numerics)
                            for l in self.layer_ids}
        if warmup:
            for t in self.tables.values():
                t.warmup()

    def _layer_addresses(self, layer_id: int, addresses: np.ndarray) -> np.ndarray:
        if layer_id not in self.tables:
            raise EngramflowError(f"this Engram memory holds layers {list(self.layer_ids)}, not {layer_id}")
        addresses = np.asarray(addresses)
        if addresses.ndim == 3:
            addresses = addresses[:, self.cfg.engram_layer_ids.index(layer_id)]
        return addresses

    def project(self, layer_id: int, addresses: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """addresses: int64 [T, n_engram_layers, columns] (all layers, as history returns them)
        or [T, columns] for this layer. Returns key [T, hc, dim], value [T, dim] (fp32)."""
        addresses = self._layer_addresses(layer_id, addresses)
        x = self.tables[layer_id].lookup(addresses, torch.bfloat16)
        return self.projections[layer_id].project(x)

    def rows(self, layer_id: int, addresses: np.ndarray) -> EngramRows:
        """The addressed rows as stored (MXFP8), for a stage that projects them itself."""
        addresses = self._layer_addresses(layer_id, addresses)
        if addresses.ndim != 2:
            raise EngramflowError(f"addresses for layer {layer_id} must be [T, columns], got {list(addresses.shape)}")
        codes, scales = self.tables[layer_id].gather(addresses)
        return EngramRows(codes, scales)

    def close(self) -> None:
        """Stop the projections' worker threads and close the stores (tier threads, sockets)."""
        for p in self.projections.values():
            p.close()
        for t in self.tables.values():
            t.close()
