"""Steps in flight: lanes of work, each with at most one step submitted and not yet collected.

A lane is a generator: it yields a step's requests and is sent that step's result when it is
collected, then yields its next step (or ends). With K pipeline stages and K lanes, stage g
works on lane a's step while stage g+1 works on lane b's: the pipeline is full instead of
K-1 stages idle. Collecting goes oldest first, so every lane gets its result in the order
the actors ran the steps, and the next step of a lane is submitted as soon as its token is
known.

    lane = group.steps()            # generation.py or data/prefill/pipeline_mode.py
    requests = next(lane)           # the lane's first step
    ticket = runner.submit(...)     # runner.py -> the backend's _submit (pipeline.py)
    ... runner.collect(ticket) ...  # oldest first
    requests = lane.send(result)    # the lane's next step

Any error abandons the steps still in flight (their writes never enter the driver's log; the
backend reconciles its components to the log) and propagates.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Generator, Iterable

from engramflow.pipeline.step import Request, StepResult, Ticket
from engramflow.validate import check_int

MAX_IN_FLIGHT = 64  # far more than any stage count; more only fills the object store

Lane = Generator[list[Request], StepResult, None]


def check_in_flight(depth) -> int:
    return check_int("steps in flight", depth, 1, MAX_IN_FLIGHT)


class StepsInFlight:
    def __init__(self, runner, depth: int):
        self.runner = runner
        self.depth = check_in_flight(depth)
        self._queue: deque[tuple[Ticket, Lane]] = deque()  # oldest first

    def start(self, lane: Lane) -> None:
        """Submit a lane's first step (after collecting the oldest step, if `depth` are in
        flight already). A lane that yields nothing is done at once."""
        while len(self._queue) >= self.depth:
            self.finish_one()
        try:
            requests = next(lane)
        except StopIteration:
            return
        self._queue.append((self.runner.submit(requests), lane))

    def finish_one(self) -> bool:
        """Collect the oldest step and hand its lane the result; submit the lane's next step.
        False when nothing was in flight."""
        if not self._queue:
            return False
        ticket, lane = self._queue.popleft()
        result = self.runner.collect(ticket)
        try:
            requests = lane.send(result)
        except StopIteration:
            return True
        self._queue.append((self.runner.submit(requests), lane))
        return True

    def run(self, lanes: Iterable[Lane]) -> None:
        """Start every lane, then collect until nothing is left in flight."""
        try:
            for lane in lanes:
                self.start(lane)
            while self.finish_one():
                pass
        except BaseException:
            self.abandon()
            raise

    def abandon(self) -> None:
        self._queue.clear()
        self.runner.abandon()

