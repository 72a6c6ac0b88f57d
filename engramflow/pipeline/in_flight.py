"""How many steps may be in flight at once: each session has at most one, and the scheduler
(scheduling/) keeps up to `depth` going so that K pipeline stages work on K steps together."""
from __future__ import annotations

from engramflow.validate import check_int

MAX_IN_FLIGHT = 64  # far more than any stage count; more only fills the object store


def check_in_flight(depth) -> int:
    return check_int("steps in flight", depth, 1, MAX_IN_FLIGHT)
