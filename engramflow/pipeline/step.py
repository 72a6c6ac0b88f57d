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
    """A step submitted to the backend and not yet collected."""
    requests: list[Request]
    handle: object = None  # the backend's: a result (in-process) or the last stage's ObjectRef
