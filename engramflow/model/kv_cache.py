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

from engramflow.errors import EngramflowError

_MIN_CAPACITY = 16


@dataclass
class _Session:
    length: int = 0
    k: torch.Tensor | None = None  # [n_layers, capacity, n_heads, head_dim]
    v: torch.Tensor | None = None

    @property
    def capacity(self) -> int:
        return 0 if self.k is None else self.k.shape[1]


class KVCache:
    def __init__(self, n_layers: int, n_heads: int, head_dim: int, max_len: int,
                 device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32):
        self.n_layers, self.n_heads, self.head_dim = n_layers, n_heads, head_dim
        self.max_len = max_len
        self.device, self.dtype = torch.device(device), dtype
        self._sessions: dict[str, _Session] = {}

    # -- lookups -----------------------------------------------------------------------------

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
        """Valid positions over all sessions: what a leak test expects back at zero."""
        return sum(s.length for s in self._sessions.values())

    # -- session lifecycle -------------------------------------------------------------------

    def open(self, session: str) -> None:
        if session in self._sessions:
            raise EngramflowError(f"session {session!r} is already open")
        self._sessions[session] = _Session()

    def close(self, session: str) -> None:
        self._get(session)
        del self._sessions[session]

    def reset(self, session: str) -> None:
        """Empty the session and drop its buffers; it stays open."""
        self._get(session)
        self._sessions[session] = _Session()

    def fork(self, src: str, dst: str) -> None:
        """`dst` becomes an independent copy of `src`'s valid positions."""
        entry = self._get(src)
        if dst in self._sessions:
            raise EngramflowError(f"cannot fork {src!r} into {dst!r}: session {dst!r} is already open")
        copy = _Session(length=entry.length)
        if entry.k is not None and entry.length:
            copy.k = entry.k[:, : entry.length].clone()
            copy.v = entry.v[:, : entry.length].clone()
        self._sessions[dst] = copy

    def truncate(self, session: str, length: int) -> None:
        entry = self._get(session)
        if isinstance(length, bool) or not isinstance(length, int) or not 0 <= length <= entry.length:
            raise EngramflowError(
                f"cannot truncate session {session!r} to length {length!r}: it holds {entry.length} positions")
        entry.length = length

    # -- used by a forward -------------------------------------------------------------------

    def _grown(self, capacity: int, needed: int) -> int:
        return min(self.max_len, max(needed, 2 * capacity, _MIN_CAPACITY))

    def reserve(self, session: str, end: int) -> None:
        """Make room for positions [0, end) without touching the valid ones."""
        entry = self._get(session)
        if end > self.max_len:
            raise EngramflowError(f"session {session!r} would reach {end} positions, above max_seq_len={self.max_len}")
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

    def commit(self, session: str, length: int) -> None:
        """Positions below `length` are now valid (after every layer has written them)."""
        self._get(session).length = length
