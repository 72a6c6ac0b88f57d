"""Telling actor faults from user errors and bugs, and the bounds on recovering from faults."""
from __future__ import annotations

import dataclasses

import ray
from ray.exceptions import GetTimeoutError, ObjectLostError, RayActorError, RayTaskError, WorkerCrashedError

from engramflow.errors import EngramflowError

# what a retry can cure: a process or node gone, an object lost with it, a step that hung
FAULTS = (RayActorError, ObjectLostError, WorkerCrashedError, GetTimeoutError)


@dataclasses.dataclass
class RecoveryPolicy:
    max_retries: int = 3  # retries of one call after recovering
    max_restarts: int = 10  # actor re-creations over the pipeline's life
    ping_timeout_s: float = 30.0  # an actor that does not answer a ping in this time is replaced
    step_timeout_s: float | None = 600.0  # a step that takes longer counts as a fault

    def __post_init__(self) -> None:
        for name in ("max_retries", "max_restarts"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise EngramflowError(f"RecoveryPolicy.{name} must be an integer >= 0, got {v!r}")
        for name in ("ping_timeout_s", "step_timeout_s"):
            v = getattr(self, name)
            if v is None and name == "step_timeout_s":
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < float("inf"):
                raise EngramflowError(f"RecoveryPolicy.{name} must be a finite number of seconds > 0, got {v!r}")


@dataclasses.dataclass
class RecoveryStats:
    faults: int = 0
    restarts: int = 0
    replayed_segments: int = 0
    max_recovery_s: float = 0.0
    events: list = dataclasses.field(default_factory=list)


def _causes(e: BaseException):
    """e and the exceptions a remote task wrapped inside it."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = getattr(e, "cause", None) if isinstance(e, RayTaskError) else None


def user_error(e: BaseException) -> EngramflowError | None:
    """The EngramflowError an actor raised, if that is what `e` is (bad input, not a fault)."""
    raised = [c for c in _causes(e) if isinstance(c, EngramflowError) and not isinstance(c, RayTaskError)]
    if raised and raised[-1].args:
        return EngramflowError(str(raised[-1].args[0]))  # the original, as the actor raised it
    return None  # constructors keep theirs as values (actors/init_guard.py)


def is_fault(e: BaseException) -> bool:
    return user_error(e) is None and any(isinstance(c, FAULTS) for c in _causes(e))


def one_line(e: BaseException) -> str:
    lines = [l for l in str(e).strip().splitlines() if l.strip()]
    return f"{type(e).__name__}: {lines[-1].strip() if lines else ''}"


def alive(actor, timeout_s: float) -> bool:
    try:
        ray.get(actor.__ray_ready__.remote(), timeout=timeout_s)
        return True
    except FAULTS:
        return False
