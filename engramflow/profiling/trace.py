"""Spans -> Chrome Trace Event Format JSON (loads in Perfetto and chrome://tracing).

One "process" per actor track (history, engram[...], stage[...], driver), so each actor gets
its own labelled row; threads inside it (the projection actor serves L1 and L14 on two
threads) become sub-rows. Complete ("X") events carry µs timestamps relative to the
earliest span, which keeps the numbers small and readable in the viewer.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

TRACK_ORDER = ("driver", "history", "engram", "stage")  # top to bottom, in pipeline order


def track_sort_key(track: str) -> tuple[int, str]:
    for i, prefix in enumerate(TRACK_ORDER):
        if track.startswith(prefix):
            return i, track
    return len(TRACK_ORDER), track


def span_category(name: str) -> str:
    """A coarse kind for colouring and filtering: project / wait / block / append / step."""
    return name.split(" ", 1)[0]


def chrome_trace(spans: list[dict]) -> dict:
    """The trace document for spans already on one clock (see clock.align)."""
    if not spans:
        return {"traceEvents": [], "displayTimeUnit": "ms"}
    origin = min(s["start_ns"] for s in spans)
    tracks = sorted({s["track"] for s in spans}, key=track_sort_key)
    trace_pid = {t: i + 1 for i, t in enumerate(tracks)}  # one viewer process per track
    events: list[dict] = []
    for track, pid in trace_pid.items():
        real_pid = next(s["pid"] for s in spans if s["track"] == track)
        events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
                       "args": {"name": f"{track} (pid {real_pid})"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0,
                       "args": {"sort_index": pid}})
    threads: dict[tuple[str, int], int] = {}
    for s in sorted(spans, key=lambda s: s["start_ns"]):
        key = (s["track"], s["tid"])
        if key not in threads:  # small per-track thread numbers read better than OS idents
            threads[key] = sum(1 for k in threads if k[0] == s["track"]) + 1
            events.append({"ph": "M", "name": "thread_name", "pid": trace_pid[s["track"]],
                           "tid": threads[key], "args": {"name": f"thread {threads[key]}"}})
        events.append({"ph": "X", "name": s["name"], "cat": span_category(s["name"]),
                       "pid": trace_pid[s["track"]], "tid": threads[key],
                       "ts": (s["start_ns"] - origin) / 1e3, "dur": max(0, s["end_ns"] - s["start_ns"]) / 1e3,
                       "args": dict(s.get("args") or {})})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"origin_unix_ns": origin, "clock": "driver wall clock"}}


def write_json_atomic(path: str | Path, doc) -> Path:
    """Write via a temporary file and rename, so a failed run leaves no half-written file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        os.fchmod(fd, 0o644)  # mkstemp makes 0600; results are meant to be shared
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    return path


def write_trace(path: str | Path, spans: list[dict]) -> Path:
    return write_json_atomic(path, chrome_trace(spans))
