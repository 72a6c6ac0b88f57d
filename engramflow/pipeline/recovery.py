"""Recovering from actor faults: the bounds (RecoveryPolicy) and the one object that does it.

The driver's session log is the truth. On a fault, `Recovery` replaces the actors that died,
reconciles every stateful actor to the log and replays the log's writes through the whole
pipeline, then submits the steps in flight again. User errors and bugs are never retried:
they surface at once as one-line EngramflowErrors. This object alone counts what recovery
did (and exports the counts as Ray metrics).
"""
from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import TypeVar

import ray
from ray.exceptions import RayError
from ray.util.metrics import Counter

from engramflow.errors import EngramflowError
from engramflow.model.speculative import Verify
from engramflow.pipeline.faults import alive, is_fault, one_line, user_error
from engramflow.pipeline.step import Request
from engramflow.validate import check_int, check_positive

log = logging.getLogger("engramflow.pipeline")
T = TypeVar("T")
REPLAY_STEP_CHUNKS = 4  # a replay step holds one segment of many sessions, up to this many prefill chunks


@dataclasses.dataclass
class RecoveryPolicy:
    max_retries: int = 3  # retries of one call after recovering
    max_restarts: int = 10  # actor re-creations over the pipeline's life
    ping_timeout_s: float = 30.0  # an actor that does not answer a ping in this time is replaced
    step_timeout_s: float | None = 600.0  # a step that takes longer counts as a fault

    def __post_init__(self) -> None:
        for name in ("max_retries", "max_restarts"):
            check_int(f"RecoveryPolicy.{name}", getattr(self, name), 0)
        for name in ("ping_timeout_s", "step_timeout_s"):
            if getattr(self, name) is not None or name != "step_timeout_s":
                check_positive(f"RecoveryPolicy.{name}", getattr(self, name), unit="a finite number of seconds")


class Recovery:
    def __init__(self, pipe, policy: RecoveryPolicy):
        self.pipe, self.policy = pipe, policy
        self.faults = 0  # faults recovered from
        self.restarts = 0  # actors made again
        self.replayed_segments = 0  # log segments written again
        self.max_recovery_s = 0.0
        self.events: list[dict] = []  # per fault: the dead slots, the seconds it took, the error's type
        self.needs_sync = False  # stateful actors may disagree with the log: reconcile and replay
        self._counter = Counter("engramflow_recovery_total", "pipeline recovery events", tag_keys=("kind",))

    def guarded(self, call: Callable[[], T]) -> T:
        """Run `call()`; on an actor fault, recover and try again (bounded). A fault during
        recovery counts as one more attempt."""
        fault: BaseException | None = None
        for attempt in range(self.policy.max_retries + 1):
            try:
                if fault is not None:
                    self._recover(fault)
                if self.needs_sync:
                    self.sync()
                return call()
            except RayError as e:
                user = user_error(e)
                if user is not None:
                    raise user from None
                if not is_fault(e):
                    raise EngramflowError(f"pipeline actor failed: {one_line(e)}") from e
                if attempt == self.policy.max_retries:
                    raise EngramflowError(f"giving up after {attempt} retries: {one_line(e)}") from e
                fault = e
        raise AssertionError("unreachable")

    def _count(self, kind: str, n: int = 1) -> None:
        setattr(self, kind, getattr(self, kind) + n)
        if n:
            self._counter.inc(n, tags={"kind": kind})

    def _recover(self, error: BaseException) -> None:
        t0 = time.perf_counter()
        self._count("faults")
        slots = self.pipe.slots
        dead = [name for name, slot in slots.items() if not alive(slot.actor, self.policy.ping_timeout_s)]
        log.warning("actor fault (%s); dead: %s", type(error).__name__, dead or "none")
        for name in dead:
            if self.restarts >= self.policy.max_restarts:
                raise EngramflowError(f"actor {name} died and the restart budget ({self.policy.max_restarts}) is spent")
            self._count("restarts")
            ray.kill(slots[name].actor, no_restart=True)  # a hung one must let go of its GPU
            slots[name].actor = slots[name].make()
            self.needs_sync |= slots[name].stateful
        if self.needs_sync:
            self.sync()
        else:
            self.resubmit()
        seconds = time.perf_counter() - t0
        self.max_recovery_s = max(self.max_recovery_s, seconds)
        self.events.append({"dead": dead, "seconds": seconds, "error": type(error).__name__})
        log.warning("recovered in %.2f s (restarted %s)", seconds, dead)

    def sync(self) -> None:
        """Make every stateful actor hold exactly the log's sessions, then replay their writes.

        The log is the truth: an actor closes the sessions the log no longer has (a close that
        reached it before a fault), opens the ones it lacks (a new actor, an open or fork that
        did not reach it) and empties the rest; then every session's segments are written
        again through the whole pipeline, in their original chunks, the k-th segment of many
        sessions in one step (up to REPLAY_STEP_CHUNKS prefill chunks of tokens). Until this
        completes the flag stays set, so a fault during it syncs again."""
        pipe = self.pipe
        self.needs_sync = True
        pipe.ops.clear()  # the reconcile below supersedes them (the log holds every op)
        names = list(pipe.session_logs)
        pipe.fetch([a.sync_sessions.remote(names) for a in pipe.stateful_actors])
        logs = [session_log.segments for session_log in pipe.session_logs.values()]
        budget = REPLAY_STEP_CHUNKS * pipe.prefill_chunk  # tokens per replay step, at most
        for k in range(max(map(len, logs), default=0)):
            batch, tokens = [], 0
            for session, segs in zip(names, logs):
                if k >= len(segs):
                    continue
                if batch and tokens + segs[k].ids.size > budget:
                    self._replay(batch)
                    batch, tokens = [], 0
                # a verified draft block again as one (its rows as decode steps, like the first time)
                batch.append(Request(session, segs[k].ids, segs[k].start_pos, segs[k].dead,
                                     Verify() if segs[k].verified else None, images=segs[k].images))
                tokens += segs[k].ids.size
            self._replay(batch)
        self.needs_sync = False
        self.resubmit()  # the steps in flight were made before the replay

    def resubmit(self) -> None:
        """Submit every step in flight again, oldest first (after a fault: their refs may hold
        its error; each write names its start_pos, so a step already done is done again).
        With their ops again: an actor whose call never ran lacks them."""
        for ticket in self.pipe.tickets():
            ticket.ref = self.pipe.dataflow.submit(ticket.requests, ticket.ops, fresh_images=True)

    def _replay(self, batch: list[Request]) -> None:
        if batch:
            self.pipe.fetch(self.pipe.dataflow.submit(batch, fresh_images=True))
            self._count("replayed_segments", len(batch))
