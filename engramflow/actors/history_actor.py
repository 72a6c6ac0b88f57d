"""TokenizerHistoryActor: tokenizer + per-session history -> Engram row addresses.

A thin Ray wrapper over `SessionHistory`: one step's requests in, one int64 address array
[sum T, n_engram_layers, columns] out, which the driver hands (as an ObjectRef) to every
projection actor without waiting for it.
"""
from __future__ import annotations

import gc
import os

import numpy as np
import ray

from engramflow.actors.init_guard import keep_init_error
from engramflow.actors.session_ops import MemoryReleaser, apply_session_op, freeze_long_lived, rss_bytes, sync_sessions
from engramflow.errors import EngramflowError
from engramflow.io.tokenizer_file import load_checkpoint_tokenizer
from engramflow.io.checkpoint import Checkpoint
from engramflow.memory.history import SessionHistory
from engramflow.timeline import SpanRecorder


@ray.remote
@keep_init_error
class TokenizerHistoryActor:
    def __init__(self, checkpoint: str):
        self.history = SessionHistory.from_checkpoint(Checkpoint(checkpoint))
        self.tokenizer = load_checkpoint_tokenizer(checkpoint)  # its own tokenizer.json when it ships one
        self.spans = SpanRecorder("history")
        self.releaser = MemoryReleaser()
        freeze_long_lived()

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    def session_op(self, op: str, *args: str) -> None:
        apply_session_op(self.history, self._has, op, args)
        if op == "close":
            self.releaser.closed(len(self.history.sessions))

    def session_ops(self, ops: list) -> None:
        """Several (op, args) in order: the driver's deferred ones, in one call (or with a step)."""
        for op, args in ops:
            self.session_op(op, *args)

    def _has(self, session: str) -> bool:
        try:
            self.history.length(session)
            return True
        except EngramflowError:
            return False

    def sessions(self) -> list[str]:
        return self.history.sessions

    def sync_sessions(self, wanted: list[str]) -> dict:
        """Hold exactly `wanted`, all empty (the driver's log; it replays their writes next)."""
        return sync_sessions(self.history, self.history.sessions, wanted)

    def rss(self) -> dict:
        return {"pid": os.getpid(), "rss_bytes": rss_bytes(), "live_sessions": len(self.history.sessions),
                "frozen_objects": gc.get_freeze_count()}

    def append_batch(self, writes: list[tuple], ops: list = ()) -> np.ndarray:
        """`writes`: the step's (session, ids, start_pos, DEAD mask or None), in row order. `ops`:
        session ops made since the last step, applied first (they ride with the step)."""
        self.session_ops(ops)
        with self.spans.span("append", tokens=sum(ids.size for _, ids, _, _ in writes)):
            return np.concatenate([self.history.append(*w) for w in writes])

    def drain_spans(self) -> list[dict]:
        return self.spans.drain()

    def live_sessions(self) -> int:
        return len(self.history.sessions)
