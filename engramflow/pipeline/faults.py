"""Telling actor faults (a retry can cure them) from user errors and bugs (it cannot)."""
from __future__ import annotations

import ray
from ray.exceptions import GetTimeoutError, ObjectLostError, RayActorError, RayTaskError, WorkerCrashedError

from engramflow.errors import EngramflowError

# what a retry can cure: a process or node gone, an object lost with it, a step that hung
FAULTS = (RayActorError, ObjectLostError, WorkerCrashedError, GetTimeoutError)


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
