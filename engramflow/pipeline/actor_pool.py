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


def keep_idle(limit: int) -> None:
    """Keep up to `limit` idle actors of shut-down pipelines for this process's next launches
    (0, the default: end them at shutdown)."""
    global _limit
    _limit = check_int("keep_idle", limit, 0)
    if _limit == 0:
        clear()


def clear() -> None:
    """End every kept actor (and forget the ones handed out)."""
    for actors in _idle.values():
        for actor in actors:
            _kill(actor)
    _idle.clear()
    _keys.clear()


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
    global _job
    job = ray.get_runtime_context().get_job_id()
    if job != _job:  # Ray was shut down and started again: the kept handles are of another cluster
        _idle.clear()
        _keys.clear()
        _job = job
    return job


def make(cls, options: dict, *args):
    """`cls.options(**options).remote(*args)`, or a kept actor of the same class and options
    given these arguments."""
    key = _key(cls, options) if _limit else None
    if key is not None:
        _current_job()
        while _idle.get(key):
            actor = _idle[key].pop()
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
            _idle.setdefault(key, []).append(actor)
            kept += 1
        else:
            _kill(actor)


def _kill(actor) -> None:
    try:
        ray.kill(actor, no_restart=True)
    except Exception:  # already gone
        pass
