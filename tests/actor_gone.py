"""Waiting for a killed actor to be gone: `ray.kill` returns before it is."""
import time

import ray


def gone(actor, timeout_s: float = 30.0) -> bool:
    """True once the actor no longer answers (within `timeout_s`)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get(actor.__ray_ready__.remote(), timeout=timeout_s)
        except ray.exceptions.RayActorError:
            return True
        time.sleep(0.1)
    return False
