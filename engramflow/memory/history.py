"""Per-session token history -> Engram row addresses.

One object holds many sessions. Each keeps one compressed id per position (DEAD for image
positions). A token enters the history exactly once, however many Engram layers read it.
"""
from __future__ import annotations

import itertools

import numpy as np

from engramflow.errors import EngramflowError
from engramflow.kernels.hashing import DEAD, hash_window
from engramflow.io.layout import EngramLayout
from engramflow.io.token_map import TokenMap
from engramflow.sessions import new_session_name, session_entry
from engramflow.validate import check_int


class _Track:
    """A growable int64 buffer: amortized O(1) appends, O(1) truncation."""

    __slots__ = ("buf", "n")

    def __init__(self, buf: np.ndarray | None = None, n: int = 0):
        self.buf = buf if buf is not None else np.empty(64, dtype=np.int64)
        self.n = n

    def write(self, start: int, values: np.ndarray) -> None:
        end = start + values.shape[0]
        if end > self.buf.shape[0]:
            grown = np.empty(max(end, 2 * self.buf.shape[0]), dtype=np.int64)
            grown[:start] = self.buf[:start]
            self.buf = grown
        self.buf[start:end] = values
        self.n = end

    def copy(self) -> "_Track":
        return _Track(self.buf[: max(self.n, 64)].copy(), self.n)


class SessionHistory:
    def __init__(self, layout: EngramLayout, token_map: TokenMap, pad_token_id: int):
        self.layout = layout
        self.token_map = token_map
        if not 0 <= pad_token_id < token_map.vocab_size:
            raise EngramflowError(f"pad token id {pad_token_id} is outside the token map ({token_map.vocab_size} ids)")
        self.pad = int(token_map.table[pad_token_id])
        self._sessions: dict[str, _Track] = {}
        self._ids = itertools.count()

    @classmethod
    def from_config(cls, cfg, token_map: TokenMap | None = None) -> "SessionHistory":
        """History for a model config; the default token map is the V4 tokenizer's."""
        from engramflow.io.layout import build_layout

        token_map = (token_map or TokenMap.default()).check(cfg.vocab_size, cfg.engram_compressed_vocab_size)
        return cls(build_layout(cfg), token_map, cfg.engram_pad_token_id)

    @classmethod
    def from_checkpoint(cls, ckpt) -> "SessionHistory":
        """History with the checkpoint's own token map when it ships one (`engram_token_map.bin`)."""
        cfg = ckpt.config
        path = ckpt.token_map_path()
        tm = TokenMap.load(path, cfg.vocab_size, cfg.engram_compressed_vocab_size) if path else None
        return cls.from_config(cfg, tm)

    # -- sessions ---------------------------------------------------------------------------
    def open(self, session: str | None = None) -> str:
        session = self._new_name(session)
        self._sessions[session] = _Track()
        return session

    def fork(self, src: str, dst: str | None = None) -> str:
        track = self._get(src)
        dst = self._new_name(dst)
        self._sessions[dst] = track.copy()
        return dst

    def reset(self, session: str) -> None:
        self._get(session).n = 0

    def truncate(self, session: str, length: int) -> None:
        """Drop positions from `length` on (a rejected draft)."""
        track = self._get(session)
        track.n = check_int(f"truncate length of session {session!r}", length, 0, track.n)

    def close(self, session: str) -> None:
        self._get(session)
        del self._sessions[session]

    def length(self, session: str) -> int:
        return self._get(session).n

    def compressed(self, session: str) -> np.ndarray:
        t = self._get(session)
        return t.buf[: t.n].copy()

    @property
    def sessions(self) -> list[str]:
        return list(self._sessions)

    def _new_name(self, session: str | None) -> str:
        return new_session_name(session, self._sessions, self._ids)

    def _get(self, session: str) -> _Track:
        return session_entry(self._sessions, session)

    # -- tokens -----------------------------------------------------------------------------
    def append(self, session: str, token_ids, start_pos: int | None = None, dead_mask=None) -> np.ndarray:
        """Write tokens at `start_pos` (default: the end) and return their addresses.

        Returns int64 [T, n_layers, columns]. `start_pos` below the current length truncates
        there first (rollback). `dead_mask[i]` marks position i as DEAD (image span).
        Validation happens before any change, so a bad call leaves the session as it was.
        """
        track = self._get(session)
        ids = self.token_map.compress(token_ids)
        if start_pos is None:
            start_pos = track.n
        if isinstance(start_pos, bool) or not isinstance(start_pos, (int, np.integer)) or not 0 <= start_pos <= track.n:
            raise EngramflowError(f"start_pos={start_pos!r} is outside [0, {track.n}] for session {session!r}")
        start_pos = int(start_pos)
        if dead_mask is not None:
            dead = np.asarray(dead_mask)
            if dead.shape != ids.shape or dead.dtype != bool:
                raise EngramflowError(
                    f"dead_mask must be a bool array of shape {ids.shape}, got {dead.dtype} {dead.shape}")
            ids = np.where(dead, DEAD, ids)
        n_ctx = min(start_pos, self.layout.max_ngram - 1)
        window = np.concatenate([track.buf[start_pos - n_ctx: start_pos], ids])
        addresses = hash_window(window, n_ctx, self.layout, self.pad)
        track.write(start_pos, ids)
        return addresses
