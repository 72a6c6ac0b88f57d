"""Per-session attention K/V for the blocks one stage owns.

A session is a token stream (one request, or one branch of it). Each holds K and V as
[n_layers, capacity, n_heads, head_dim] buffers plus a length; only positions below the length
are valid. Capacity grows by doubling, so a decode step is a write into spare room, not a
concatenation. With n_layers == 0 the cache only tracks lengths (the emulated backbone keeps
the same session semantics without any tensors).

Rollback (speculative decoding, prefix reuse) is just a shorter length: truncating never frees
or copies anything, and later writes overwrite the stale rows.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engramflow.model.session_cache import SessionCache

_MIN_CAPACITY = 16


@dataclass
class _Session:
    length: int = 0
    k: torch.Tensor | None = None  # [n_layers, capacity, n_heads, head_dim]
    v: torch.Tensor | None = None

    @property
    def capacity(self) -> int:
        return 0 if self.k is None else self.k.shape[1]


class KVCache(SessionCache):
    def __init__(self, n_layers: int, n_heads: int, head_dim: int, max_len: int,
                 device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32):
        super().__init__(max_len)
        self.n_layers, self.n_heads, self.head_dim = n_layers, n_heads, head_dim
        self.device, self.dtype = torch.device(device), dtype

    def _new_entry(self) -> _Session:
        return _Session()

    def _fork_entry(self, entry: _Session) -> _Session:
        copy = _Session(length=entry.length)
        if entry.k is not None and entry.length:
            copy.k = entry.k[:, : entry.length].clone()
            copy.v = entry.v[:, : entry.length].clone()
        return copy

    # -- used by a forward -------------------------------------------------------------------

    def _grown(self, capacity: int, needed: int) -> int:
        return min(self.max_len, max(needed, 2 * capacity, _MIN_CAPACITY))

    def reserve(self, session: str, end: int) -> None:
        """Make room for positions [0, end) without touching the valid ones."""
        entry = self._get(session)
        self.check_end(session, end)
        if self.n_layers == 0 or end <= entry.capacity:
            return
        cap = self._grown(entry.capacity, end)
        shape = (self.n_layers, cap, self.n_heads, self.head_dim)
        k = torch.empty(shape, device=self.device, dtype=self.dtype)
        v = torch.empty(shape, device=self.device, dtype=self.dtype)
        if entry.length:
            k[:, : entry.length] = entry.k[:, : entry.length]
            v[:, : entry.length] = entry.v[:, : entry.length]
        entry.k, entry.v = k, v

    def layer(self, session: str, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole K and V buffers of one owned layer ([capacity, n_heads, head_dim] views)."""
        entry = self._get(session)
        return entry.k[layer], entry.v[layer]
