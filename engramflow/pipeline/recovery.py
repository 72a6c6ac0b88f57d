"""Telling actor faults from user errors and bugs, and the bounds on recovering from faults."""
from __future__ import annotations

import dataclasses
import re

import ray
from ray.exceptions import GetTimeoutError, ObjectLostError, RayActorError, RayTaskError, WorkerCrashedError

from engramflow.errors import EngramflowError

# what a retry can cure: a process or node gone, an object lost with it, a step that hung
FAULTS = (RayActorError, ObjectLostError, WorkerCrashedError, GetTimeoutError)
_USER_LINE = re.compile(r"EngramflowError: (.+)")


@dataclasses.dataclass
class RecoveryPolicy:
    max_retries: int = 3  # retries of one call after recovering
    max_restarts: int = 10  # actor re-creations over the pipeline's life
    ping_timeout_s: float = 30.0  # an actor that does not answer a ping in this time is replaced
    step_timeout_s: float | None = 600.0  # a step that takes longer counts as a fault


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
    raised = [c for c in _causes(e) if isinstance(c, EngramflowError)]
    if raised and not isinstance(raised[-1], RayTaskError) and raised[-1].args:
        return EngramflowError(str(raised[-1].args[0]))  # the original, as the actor raised it
    if raised or (isinstance(e, RayActorError) and getattr(e, "actor_init_failed", False)):
        # otherwise (e.g. a constructor's error) it survives only as text in Ray's message
        found = _USER_LINE.findall(str(e))
        if found:
            return EngramflowError(found[-1].strip())
    return None


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
