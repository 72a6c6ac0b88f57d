"""Per-session caches of a V4.1 stage (V41_MODEL.md §8), with rollback.

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

from engramflow.errors import EngramflowError

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


class V41Cache:
    """Same session interface as kv_cache.KVCache (open, close, reset, fork, truncate, reserve,
    commit), over named buffers."""

    def __init__(self, specs: dict[str, BufferSpec], max_len: int, device: str | torch.device = "cpu"):
        self.specs, self.max_len, self.device = specs, max_len, torch.device(device)
        self._sessions: dict[str, _Session] = {}

    def _get(self, session: str) -> _Session:
        entry = self._sessions.get(session)
        if entry is None:
            raise EngramflowError(f"unknown session {session!r} (open it first)")
        return entry

    def __contains__(self, session: str) -> bool:
        return session in self._sessions

    def length(self, session: str) -> int:
        return self._get(session).length

    def live_sessions(self) -> int:
        return len(self._sessions)

    def cached_positions(self) -> int:
        return sum(s.length for s in self._sessions.values())

    def open(self, session: str) -> None:
        if session in self._sessions:
            raise EngramflowError(f"session {session!r} is already open")
        self._sessions[session] = _Session()

    def close(self, session: str) -> None:
        self._get(session)
        del self._sessions[session]

    def reset(self, session: str) -> None:
        self._get(session)
        self._sessions[session] = _Session()

    def fork(self, src: str, dst: str) -> None:
        entry = self._get(src)
        if dst in self._sessions:
            raise EngramflowError(f"cannot fork {src!r} into {dst!r}: session {dst!r} is already open")
        self._sessions[dst] = _Session(entry.length, entry.capacity,
                                       {k: v.clone() for k, v in entry.buffers.items()})

    def truncate(self, session: str, length: int) -> None:
        entry = self._get(session)
        if isinstance(length, bool) or not isinstance(length, int) or not 0 <= length <= entry.length:
            raise EngramflowError(
                f"cannot truncate session {session!r} to length {length!r}: it holds {entry.length} positions")
        entry.length = length

    def reserve(self, session: str, end: int) -> None:
        entry = self._get(session)
        if end > self.max_len:
            raise EngramflowError(f"session {session!r} would reach {end} positions, above max_seq_len={self.max_len}")
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

    def commit(self, session: str, length: int) -> None:
        self._get(session).length = length
