"""Telling actor faults from user errors, and the bounds on recovering from them."""
from __future__ import annotations

import dataclasses

import ray
from ray.exceptions import RayActorError, RayTaskError

from engramflow.errors import EngramflowError


@dataclasses.dataclass
class RecoveryPolicy:
    max_retries: int = 3  # retries of one step after recovering
    max_restarts: int = 10  # actor re-creations over the pipeline's life
    ping_timeout_s: float = 30.0


@dataclasses.dataclass
class RecoveryStats:
    faults: int = 0
    restarts: int = 0
    replayed_segments: int = 0
    max_recovery_s: float = 0.0
    events: list = dataclasses.field(default_factory=list)


def user_error(e: BaseException) -> EngramflowError | None:
    """The EngramflowError an actor raised, if that is what `e` is (bad input, not a fault)."""
    while isinstance(e, RayTaskError):
        cause = e.cause if hasattr(e, "cause") else None
        if cause is None or cause is e:
            break
        e = cause
    if isinstance(e, EngramflowError):
        return e
    return None



def alive(actor, timeout_s: float) -> bool:
    try:
        ray.get(actor.__ray_ready__.remote(), timeout=timeout_s)
        return True
    except (RayActorError, ray.exceptions.GetTimeoutError):
        return False
