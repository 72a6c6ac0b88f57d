"""Per-session caches of a V4.1 stage (docs/v41.md, "Caches and decode"), with rollback.

Every cache is a buffer indexed by position (or by compressed row = position // ratio), so a
session is just `length` plus buffers; truncating to L keeps rows below L (or below L // ratio)
and later writes overwrite the rest. That makes rollback, fork and chunked prefill exact:

* window KV of every owned layer: post-RoPE, FP8-QDQ'd [pos, head_dim] bf16. All positions are
  kept, not a 128-slot ring, so a rollback past the window still finds its keys;
* compressed KV and index keys of every compressing layer: [pos // ratio, width] bf16;
* the compressor carry of ratio > 1 layers: each position's kv and gate logits (fp32), from
  which an incomplete group is pooled once its last token arrives.
Capacity grows by doubling (a decode step is a write, not a concatenation).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engramflow.model.session_cache import SessionCache

_MIN_CAPACITY = 16


@dataclass(frozen=True)
class BufferSpec:
    per: int          # positions per row (1, or the compress ratio)
    width: int
    dtype: torch.dtype


@dataclass
class _Session:
    length: int = 0
    capacity: int = 0
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)


class V41Cache(SessionCache):
    """Named buffers per session (the session interface is SessionCache's)."""

    def __init__(self, specs: dict[str, BufferSpec], max_len: int, device: str | torch.device = "cpu"):
        super().__init__(max_len)
        self.specs, self.device = specs, torch.device(device)

    def _new_entry(self) -> _Session:
        return _Session()

    def _fork_entry(self, entry: _Session) -> _Session:
        return _Session(entry.length, entry.capacity, {k: v.clone() for k, v in entry.buffers.items()})

    def reserve(self, session: str, end: int) -> None:
        entry = self._get(session)
        self.check_end(session, end)
        if end <= entry.capacity:
            return
        cap = min(self.max_len, max(end, 2 * entry.capacity, _MIN_CAPACITY))
        grown = {}
        for name, spec in self.specs.items():
            buf = torch.zeros(cap // spec.per + 1, spec.width, dtype=spec.dtype, device=self.device)
            old = entry.buffers.get(name)
            if old is not None:
                buf[: old.shape[0]] = old
            grown[name] = buf
        entry.buffers, entry.capacity = grown, cap

    def buffer(self, session: str, name: str) -> torch.Tensor:
        return self._get(session).buffers[name]
