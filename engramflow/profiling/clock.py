"""Clock offsets of actor processes against the driver, by round-trip pings.

Spans carry each process's own wall clock (time.time_ns). On one host those agree, across
nodes they may drift by milliseconds — as long as a decode step. For each actor we ask for
its clock a few times and keep the sample with the shortest round trip: its clock reading
happened somewhere inside that round trip, so assuming the middle bounds the error by half of
it (the NTP estimate). An actor on the driver's own node reads the same clock, so its offset
is exactly zero: an estimate there would only add its error (up to half a round trip, a
millisecond on a busy host) to every hop measured against it. `__ray_call__` runs a function on the actor itself, so the actor
classes need no extra method.
"""
from __future__ import annotations

import dataclasses
import os
import time

import ray


@dataclasses.dataclass(frozen=True)
class ClockOffset:
    pid: int
    offset_ns: int  # actor clock minus driver clock: subtract it to get driver time
    error_ns: int   # half the best round trip: the bound on the estimate


def _actor_clock(_actor_self) -> tuple[int, int, str]:
    return os.getpid(), time.time_ns(), ray.get_runtime_context().get_node_id()


def measure_offset(actor, pings: int = 5) -> ClockOffset:
    best = None
    here = ray.get_runtime_context().get_node_id()
    for _ in range(pings):
        t0 = time.time_ns()
        pid, remote, node = ray.get(actor.__ray_call__.remote(_actor_clock))
        t1 = time.time_ns()
        if node == here:
            return ClockOffset(pid, 0, 0)
        if best is None or t1 - t0 < best[0]:
            best = (t1 - t0, remote - (t0 + t1) // 2, pid)
    rtt, offset, pid = best
    return ClockOffset(pid, offset, rtt // 2)


def measure_offsets(actors, pings: int = 5) -> dict[int, ClockOffset]:
    """pid -> offset for every actor (spans name their process by pid)."""
    return {o.pid: o for o in (measure_offset(a, pings) for a in actors)}


def align(spans: list[dict], offsets: dict[int, ClockOffset]) -> list[dict]:
    """Copies of the spans with start/end moved onto the driver's clock."""
    out = []
    for s in spans:
        off = offsets[s["pid"]].offset_ns if s["pid"] in offsets else 0
        out.append(s | {"start_ns": s["start_ns"] - off, "end_ns": s["end_ns"] - off})
    return out
