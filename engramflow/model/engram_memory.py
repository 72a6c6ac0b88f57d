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
from engramflow.tiers.prefetch import CHUNK_TOKENS, is_io_bound, pipelined_lookup, submit_lookup


class EngramMemory:
    prefetch_tokens = CHUNK_TOKENS  # prefill chunk when rows come from an I/O-bound tier

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
        store, proj = self.tables[layer_id], self.projections[layer_id]
        if is_io_bound(store) and addresses.shape[0] > self.prefetch_tokens:
            # prefill from an I/O-bound tier: chunk i+1's reads in flight while chunk i is
            # projected. Every chunk stays longer than the projection's decode (GEMV) size, so it
            # takes the one-shot's GEMM path: the same K/V, bit for bit (rows are independent);
            # a short tail joins the chunk before it (each call re-reads the whole weight)
            small = max(getattr(proj, "decode_max_tokens", 0), self.prefetch_tokens // 2)
            parts = [proj.project(x) for _, _, x in
                     pipelined_lookup(store, addresses, max(self.prefetch_tokens, small + 1), min_tokens=small)]
            return torch.cat([k for k, _ in parts]), torch.cat([v for _, v in parts])
        return proj.project(store.lookup(addresses, torch.bfloat16))

    def project_all(self, addresses: np.ndarray) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """{layer: (key, value)} for addresses [T, n_engram_layers, columns]. Layers whose rows come
        from an I/O-bound tier start their lookups together first (both layers' reads in flight
        at once), then each is projected as its rows arrive; the same K/V as project() per layer."""
        addresses = np.asarray(addresses)
        ids = self.cfg.engram_layer_ids
        early = {l: submit_lookup(self.tables[l], addresses[:, ids.index(l)]) for l in self.layer_ids
                 if is_io_bound(self.tables[l]) and addresses.shape[0] <= self.prefetch_tokens}
        out = {}
        try:
            for l in self.layer_ids:
                out[l] = (self.projections[l].project(early.pop(l).result()) if l in early
                          else self.project(l, addresses))
        finally:
            for f in early.values():  # an error above: let the other reads finish before returning
                f.cancel() or f.exception()
        return out

    def rows(self, layer_id: int, addresses: np.ndarray) -> EngramRows:
        """The addressed rows as stored (MXFP8), for a stage that projects them itself."""
        addresses = self._layer_addresses(layer_id, addresses)
        if addresses.ndim != 2:
            raise EngramflowError(f"addresses for layer {layer_id} must be [T, columns], got {list(addresses.shape)}")
        codes, scales = self.tables[layer_id].gather(addresses)
        return EngramRows(codes, scales)

    def close(self) -> None:
        """Close the stores (tier threads, sockets); the projections hold nothing to release (their
        threads are the C library's process-wide pool)."""
        for t in self.tables.values():
            t.close()
