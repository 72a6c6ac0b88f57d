"""A session's writes, kept by the driver as the source of truth.

Each successful step appends a segment (start_pos, ids, dead mask); a write below the current
length first cuts the log there (rollback), exactly as history and KV caches do. Replaying the
segments in order rebuilds any actor's state for the session, with the same chunking as the
original run.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from engramflow.model.vision import clip_slots


@dataclasses.dataclass(frozen=True)
class Segment:
    start_pos: int
    ids: np.ndarray  # int64 [T]
    dead: np.ndarray | None = None  # bool [T]
    verified: bool = False  # written as a verified draft block (rows as decode steps): replayed as one
    images: tuple = ()  # ImageSlots, positions relative to start_pos


class SessionLog:
    def __init__(self, segments: list[Segment] | None = None):
        self.segments: list[Segment] = list(segments or [])

    @property
    def length(self) -> int:
        return self.segments[-1].start_pos + self.segments[-1].ids.size if self.segments else 0

    def tokens(self) -> list[int]:
        return [int(t) for s in self.segments for t in s.ids]

    def truncate(self, pos: int) -> None:
        keep = []
        for s in self.segments:
            if s.start_pos >= pos:
                break
            n = min(s.ids.size, pos - s.start_pos)
            keep.append(s if n == s.ids.size else Segment(s.start_pos, s.ids[:n], None if s.dead is None else s.dead[:n],
                                                          s.verified, clip_slots(s.images, 0, n)))
        self.segments = keep

    def write(self, start_pos: int, ids: np.ndarray, dead: np.ndarray | None, verified: bool = False,
              images: tuple = ()) -> None:
        self.truncate(start_pos)
        self.segments.append(Segment(start_pos, np.array(ids, dtype=np.int64),
                                     None if dead is None else np.array(dead, dtype=bool), verified, tuple(images)))

    def copy(self) -> "SessionLog":
        return SessionLog(self.segments)  # segments are immutable
