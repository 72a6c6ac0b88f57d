"""One forward step of the runner: its requests, its result, and its ticket while in flight."""
from __future__ import annotations

import dataclasses

import numpy as np

from engramflow.model.sampling import Pick


@dataclasses.dataclass
class Request:
    """One session's slice of a step: tokens written at start_pos."""
    session: str
    ids: np.ndarray  # int64 [T]
    start_pos: int
    dead: np.ndarray | None = None  # bool [T], image positions
    pick: Pick | None = None  # the last stage returns a Picked instead of the logits
    images: tuple = ()  # ImageSlots: span rows written over these positions' embeddings


@dataclasses.dataclass
class StepResult:
    """Per request: fp32 logits of its last position (a Picked where the request carried a
    Pick); per Engram layer: exposed wait (ms)."""
    logits: list
    exposed_wait_ms: dict[int, float]
    spans: list = dataclasses.field(default_factory=list)
    bytes_moved: dict[int, int] = dataclasses.field(default_factory=dict)  # Engram bytes shipped to the stages, per layer


@dataclasses.dataclass(eq=False)
class Ticket:
    """A step submitted to the backend and not yet collected. An in-process backend computes
    at submit (`result`); the Ray pipeline holds the last stage's output ref (`ref`), the
    held-back session ops that rode with the step (sent again if it is resubmitted) and when
    it was submitted (its wall time feeds metrics and the projection placement)."""
    requests: list[Request]
    result: StepResult | None = None
    ref: object = None
    ops: list = dataclasses.field(default_factory=list)
    submitted_at: float = 0.0

    @property
    def tokens(self) -> int:
        return sum(r.ids.size for r in self.requests)
