"""Steps in flight: up to `depth` steps handed to the backend and not yet collected.

With K pipeline stages and K independent groups of sessions in flight, stage g works on group
a's step while stage g+1 works on group b's: the pipeline is full instead of K-1 stages idle.
A step's callback runs when it is collected (oldest first) and may submit that group's next
step at once (its token is known now), so every group always has one step in flight.

Any error abandons the steps still in flight (their writes never enter the driver's log; the
backend reconciles its components to the log) and propagates.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable

from engramflow.errors import EngramflowError
from engramflow.pipeline.step import Request, StepResult

MAX_IN_FLIGHT = 64  # far more than any stage count; more only fills the object store


def check_in_flight(depth) -> int:
    if isinstance(depth, bool) or not isinstance(depth, int) or not 1 <= depth <= MAX_IN_FLIGHT:
        raise EngramflowError(f"steps in flight must be an integer in [1, {MAX_IN_FLIGHT}], got {depth!r}")
    return depth


class StepsInFlight:
    def __init__(self, runner, depth: int):
        self.runner = runner
        self.depth = check_in_flight(depth)
        self._queue: deque = deque()  # (ticket, callback), oldest first

    def submit(self, requests: list[Request], then: Callable[[StepResult], None]) -> None:
        """Submit a step; `then(result)` runs when it is collected. Waits for the oldest step
        first when `depth` steps are already in flight."""
        while len(self._queue) >= self.depth:
            self._finish_oldest()
        self._queue.append((self.runner.submit(requests), then))

    def run(self, start: Callable[[], None]) -> None:
        """`start()` submits the first steps; then collect until nothing is left in flight."""
        try:
            start()
            while self.finish_one():
                pass
        except BaseException:
            self.abandon()
            raise

    def finish_one(self) -> bool:
        """Collect the oldest step and run its callback; False when nothing was in flight."""
        if not self._queue:
            return False
        self._finish_oldest()
        return True

    def abandon(self) -> None:
        self._queue.clear()
        self.runner.abandon()

    def _finish_oldest(self) -> None:
        ticket, then = self._queue.popleft()
        then(self.runner.collect(ticket))
