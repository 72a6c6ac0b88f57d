"""Idle actor processes a driver keeps for its next launch (off unless `keep_idle(n)` asks).

Every launch starts an actor process per stage and one for the history, and each pays its
start: a Ray worker and, for a stage, `import torch` (2-4 CPU-s on a busy small machine, most of
a small pipeline's launch). A driver that launches pipeline after pipeline (a notebook, a
sweep, the test suite) can keep the actors of a pipeline it shut down and hand them to its next
launch, which runs their constructor again with its own arguments (`reinit`, actors/init_guard.py):
of the old pipeline only the process survives. Only actors that hold no Ray resources are kept
(no CPUs, GPUs, custom resources or placement group): an idle one must not keep a CPU from the
next launch or from another job. An actor that cannot be re-initialised (dead, or its
constructor refuses the new arguments) is ended and a fresh one made, which then reports its
own error as any launch does.

A kept actor waits parked, its old state dropped: blocked in a call (`park`,
actors/init_guard.py) until a small async actor of the pool, the gate, lets it go. An idle Ray actor's process wakes 100 times a
second to check for signals (~1 % of a core each, measured); a blocked one sleeps (~0.2 %), so
keeping many costs about one idle process, the gate's.
"""
from __future__ import annotations

import ray
from ray.exceptions import GetTimeoutError, RayError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from engramflow.validate import check_int

REINIT_TIMEOUT_S = 120.0

_limit = 0
_job = None  # the Ray job the kept actors belong to: a new ray.init makes them strangers
_idle: dict[tuple, list] = {}  # key -> idle actors
_keys: dict[str, tuple] = {}  # actor id -> its key, for the actors handed out while keeping
_gate = None  # where kept actors wait (made at the first keep)


@ray.remote(num_cpus=0)
class Gate:
    """Parked actors wait here, one token each, until `open`: a call may come before the wait."""

    def __init__(self):
        self.events = {}

    def _event(self, token: str):
        import asyncio

        return self.events.setdefault(token, asyncio.Event())

    async def wait(self, token: str) -> None:
        await self._event(token).wait()
        self.events.pop(token, None)

    async def open(self, token: str) -> None:
        self._event(token).set()

    async def taken(self, token: str) -> bool:
        """Whether `token` is open already (its actor handed out before it could park): then
        forgotten, as a wait would forget it."""
        if token in self.events and self.events[token].is_set():
            del self.events[token]
            return True
        return False


def keep_idle(limit: int) -> None:
    """Keep up to `limit` idle actors of shut-down pipelines for this process's next launches
    (0, the default: end them at shutdown)."""
    global _limit
    _limit = check_int("keep_idle", limit, 0)
    if _limit == 0:
        clear()


def clear() -> None:
    """End every kept actor and the gate (and forget the ones handed out)."""
    global _gate
    for actors in _idle.values():
        for actor in actors:
            _kill(actor)
    if _gate is not None:
        _kill(_gate)
    _idle.clear()
    _keys.clear()
    _gate = None


def _key(cls, options: dict) -> tuple | None:
    """What makes two actors interchangeable: the class and every option; None for an actor
    that holds resources (or is placed by anything but a node)."""
    if options.get("num_cpus", 1) != 0 or options.get("num_gpus") or options.get("resources"):
        return None
    strategy = options.get("scheduling_strategy")
    if strategy is not None and not isinstance(strategy, NodeAffinitySchedulingStrategy):
        return None
    where = None if strategy is None else (strategy.node_id, strategy.soft)
    rest = repr(sorted((k, v) for k, v in options.items() if k != "scheduling_strategy"))
    return cls, rest, where


def _current_job():
    global _job, _gate
    job = ray.get_runtime_context().get_job_id()
    if job != _job:  # Ray was shut down and started again: the kept handles are of another cluster
        _idle.clear()
        _keys.clear()
        _gate = None
        _job = job
    return job


def _park(actor) -> None:
    global _gate
    if _gate is None:
        _gate = Gate.remote()
    actor.park.remote(_gate, actor._actor_id.hex())


def _unpark(actor) -> None:
    _gate.open.remote(actor._actor_id.hex())  # the actor's next call runs once its park returns


def make(cls, options: dict, *args):
    """`cls.options(**options).remote(*args)`, or a kept actor of the same class and options
    given these arguments."""
    key = _key(cls, options) if _limit else None
    if key is not None:
        _current_job()
        while _idle.get(key):
            actor = _idle[key].pop()
            _unpark(actor)
            try:
                if ray.get(actor.reinit.remote(*args), timeout=REINIT_TIMEOUT_S) is None:
                    _keys[actor._actor_id.hex()] = key
                    return actor
            except (RayError, GetTimeoutError):
                pass
            _kill(actor)  # a fresh actor reports the error the way a launch does
    actor = cls.options(**options).remote(*args)
    if key is not None:
        _keys[actor._actor_id.hex()] = key
    return actor


def release(actors: list) -> None:
    """Keep what may be kept (while there is room), end the rest."""
    if _keys:
        _current_job()
    kept = sum(map(len, _idle.values()))
    for actor in actors:
        key = _keys.pop(actor._actor_id.hex(), None)
        if key is not None and kept < _limit:
            _park(actor)
            _idle.setdefault(key, []).append(actor)
            kept += 1
        else:
            _kill(actor)


def _kill(actor) -> None:
    try:
        ray.kill(actor, no_restart=True)
    except Exception:  # already gone
        pass
