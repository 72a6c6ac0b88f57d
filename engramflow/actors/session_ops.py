"""Session operations on an actor's component, safe to repeat after a fault.

The driver validates every open/fork/reset/close before sending it, so when one is sent again
after a fault (it may have reached some actors before another died), an effect that is already
there is not an error: a second open resets, a second close is a no-op, a fork replaces its
half-made copy.
"""
from __future__ import annotations

from collections.abc import Callable


def apply_session_op(component, has: Callable[[str], bool], op: str, args: tuple, retry: bool) -> None:
    if op not in ("open", "fork", "reset", "close"):
        raise ValueError(f"unknown session op {op!r}")
    if retry:
        if op == "open" and has(args[0]):
            op = "reset"
        elif op == "close" and not has(args[0]):
            return
        elif op == "fork" and has(args[1]):
            component.close(args[1])
    getattr(component, op)(*args)
