"""Session ops held back while steps are in flight, and the ones sent without waiting.

While a schedule of steps runs, opening and closing sessions must not cost an actor call (or
a wait) each: an op made then is held here and rides with the next step's calls (the history
append and every stage forward run it first). What is still held when the schedule ends is
sent in one call per stateful actor, without waiting; those calls' faults are raised when a
later step is collected (`settle`). The driver's log already holds every op, so recovery may
drop all of this (`clear`) and reconcile the actors to the log instead.
"""
from __future__ import annotations

from collections.abc import Callable

import ray


class HeldOps:
    def __init__(self, get: Callable):
        self._get = get  # ray.get under the pipeline's step timeout
        self._held: list[tuple[str, tuple]] = []  # (op, args), in the order they were made
        self._sent: list = []  # refs of the flushes not yet checked

    def hold(self, op: str, args: tuple) -> None:
        self._held.append((op, args))

    def take(self) -> list[tuple[str, tuple]]:
        """The held ops, for the next step to carry (they are no longer held)."""
        ops, self._held = self._held, []
        return ops

    def flush(self, actors: list) -> None:
        """Send the held ops in one call per actor, without waiting (checked by `settle`)."""
        if self._held:
            ops = self.take()
            self._sent += [a.session_ops.remote(ops) for a in actors]

    def settle(self, block: bool) -> None:
        """Raise the fault of any flush that has finished (of every flush: `block`)."""
        if not self._sent:
            return
        if block:
            done, self._sent = self._sent, []
        else:
            done, self._sent = ray.wait(self._sent, num_returns=len(self._sent), timeout=0)
        self._get(done)

    def clear(self) -> None:
        """Forget everything: a reconcile to the driver's log supersedes it."""
        self._held, self._sent = [], []
