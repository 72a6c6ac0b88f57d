"""Cheap timeline spans, on by default: (name, start, end, args) in wall-clock ns.

Wall-clock (time.time_ns) rather than a monotonic clock so spans from different processes
and nodes share one timeline (NTP-synced hosts agree to well under a millisecond). Each actor
keeps a bounded buffer that the driver drains into a Chrome trace.
"""
from __future__ import annotations

import collections
import contextlib
import os
import threading
import time


class SpanRecorder:
    def __init__(self, track: str, limit: int = 100_000):
        self.track = track
        self.pid = os.getpid()
        self._buf: collections.deque = collections.deque(maxlen=limit)
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def span(self, name: str, **args):
        start = time.time_ns()
        try:
            yield
        finally:
            self.add(name, start, time.time_ns(), **args)

    def add(self, name: str, start_ns: int, end_ns: int, **args) -> None:
        with self._lock:
            self._buf.append({"track": self.track, "pid": self.pid, "tid": threading.get_ident(),
                              "name": name, "start_ns": start_ns, "end_ns": end_ns, "args": args})

    def drain(self) -> list[dict]:
        with self._lock:
            out = list(self._buf)
            self._buf.clear()
        return out
