"""TokenizerHistoryActor: tokenizer + per-session history -> Engram row addresses.

A thin Ray wrapper over `SessionHistory`: one step's requests in, one int64 address array
[sum T, n_engram_layers, columns] out, which the driver hands (as an ObjectRef) to every
projection actor without waiting for it.
"""
from __future__ import annotations

import numpy as np
import ray

from engramflow.actors.init_guard import keep_init_error
from engramflow.actors.session_ops import apply_session_op
from engramflow.io.token_map import load_tokenizer
from engramflow.io.checkpoint import Checkpoint
from engramflow.memory.history import SessionHistory
from engramflow.timeline import SpanRecorder


@ray.remote
@keep_init_error
class TokenizerHistoryActor:
    def __init__(self, checkpoint: str):
        self.history = SessionHistory.from_checkpoint(Checkpoint(checkpoint))
        self.tokenizer = load_tokenizer()
        self.spans = SpanRecorder("history")

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    def session_op(self, op: str, *args: str, retry: bool = False) -> None:
        apply_session_op(self.history, lambda s: s in self.history.sessions, op, args, retry)

    def append_batch(self, requests: list) -> np.ndarray:
        with self.spans.span("append", tokens=sum(r.ids.size for r in requests)):
            return np.concatenate([self.history.append(r.session, r.ids, r.start_pos, r.dead) for r in requests])

    def drain_spans(self) -> list[dict]:
        return self.spans.drain()

    def live_sessions(self) -> int:
        return len(self.history.sessions)
