"""The actor hops of each traced step, and what each costs (a step's critical path).

From the driver's submit ("step" span start) to its result (span end) a step crosses:
  driver -> history            the address append starts
  history -> projection Ln     the projection (or, rows placement, the gather) of layer n starts
  projection Ln -> stage       the stage resumes after waiting for layer n's K/V (only when it
                               waited: otherwise the projection was off the critical path)
  driver -> stage[a,b)         the first stage's call starts
  stage[..] -> stage[..]       the next stage's call starts after the previous one's returned
  stage[..] -> driver          the result is back on the driver
Each is measured as the gap between the two spans on the driver's clock, so it holds Ray's
call and transfer costs (and any queueing), not the work on either side. A traced pipeline marks
the instants its history and first-stage calls leave the driver and its result is back
("send history", "send stage", "result"): the driver's hops start and end there, and the
driver's own work before and after (building the requests, the session log, settling held
ops) is reported apart, as "driver before send" and "driver after result". A stage's work is its
"call" span (the whole actor method: unpacking, blocks, the last stage's head and pick,
packing); traces without one fall back to the stage's first and last block.
"""
from __future__ import annotations

import re
import statistics

_STAGE = re.compile(r"stage\[(\d+),(\d+)\)$")
_WAIT = re.compile(r"wait L(\d+)$")
_PROJECT = re.compile(r"(?:project|rows) L(\d+)$")  # K/V projected on the host, or rows gathered


def _ms(a_ns: int, b_ns: int) -> float:
    return (b_ns - a_ns) / 1e6


def _mark(marks: list[dict], name: str, default: int) -> int:
    times = [m["start_ns"] for m in marks if m["name"] == name]
    return times[-1] if times else default  # the last: a retried step is sent again


def driver_work(step: dict, marks: list[dict]) -> dict[str, float]:
    """The driver's own ms before its first call leaves and after the result is back."""
    out = {}
    if any(m["name"] == "send history" for m in marks):
        out["driver before send"] = _ms(step["start_ns"], _mark(marks, "send history", step["start_ns"]))
    if any(m["name"] == "result" for m in marks):
        out["driver after result"] = _ms(_mark(marks, "result", step["end_ns"]), step["end_ns"])
    return out


def step_hops(step: dict, spans: list[dict], marks: list[dict] = ()) -> dict[str, float]:
    """Hop name -> ms for one step; `spans` are the non-driver spans that start inside it,
    `marks` the driver's send/result marks inside it (without them the step's own ends count)."""
    t0, t1 = step["start_ns"], step["end_ns"]
    hops: dict[str, float] = {}
    append = next((s for s in spans if s["track"] == "history" and s["name"] == "append"), None)
    projections = {int(m.group(1)): s for s in spans if (m := _PROJECT.match(s["name"]))}
    if append is not None:
        hops["driver -> history"] = _ms(_mark(marks, "send history", t0), append["start_ns"])
        for layer, p in sorted(projections.items()):
            hops[f"history -> projection L{layer}"] = _ms(append["end_ns"], p["start_ns"])
    for s in spans:
        m = _WAIT.match(s["name"])
        p = projections.get(int(m.group(1))) if m else None
        if p is not None and s["start_ns"] < p["end_ns"] <= s["end_ns"]:  # the stage was waiting for it
            hops[f"projection L{m.group(1)} -> stage"] = _ms(p["end_ns"], s["end_ns"])
    blocks: dict[tuple[int, int], list[dict]] = {}
    calls: dict[tuple[int, int], list[dict]] = {}
    for s in spans:
        m = _STAGE.match(s["track"])
        if m and s["name"].startswith("block "):
            blocks.setdefault((int(m.group(1)), int(m.group(2))), []).append(s)
        elif m and s["name"] == "call":
            calls.setdefault((int(m.group(1)), int(m.group(2))), []).append(s)
    previous, prev_end = "driver", _mark(marks, "send stage", t0)
    for (a, b), bs in sorted(blocks.items()):
        bs = calls.get((a, b), bs)
        name = f"stage[{a},{b})"
        hops[f"{previous} -> {name}"] = _ms(prev_end, min(s["start_ns"] for s in bs))
        previous, prev_end = name, max(s["end_ns"] for s in bs)
    if blocks:
        hops[f"{previous} -> driver"] = _ms(prev_end, _mark(marks, "result", t1))
    return hops


def hop_report(spans: list[dict]) -> dict:
    """Per step kind: the hops a step crosses, the median ms of each and their sum."""
    steps = [s for s in spans if s["track"] == "driver" and s["name"] == "step"]
    others = [s for s in spans if s["track"] != "driver"]
    marks = [s for s in spans if s["track"] == "driver" and s["name"] in ("send history", "send stage", "result")]
    per_kind: dict[str, list[tuple[dict, dict]]] = {}
    for step in steps:
        inside = [s for s in others if step["start_ns"] <= s["start_ns"] <= step["end_ns"]]
        own = [m for m in marks if step["start_ns"] <= m["start_ns"] <= step["end_ns"]]
        per_kind.setdefault(step["args"].get("kind", "?"), []).append(
            (step_hops(step, inside, own), driver_work(step, own)))
    out = {}
    for kind, rows in sorted(per_kind.items()):
        medians = _medians([h for h, _ in rows])
        out[kind] = {"steps": len(rows), "hops": len(medians), "median_ms": medians,
                     "total_median_ms": sum(medians.values()), "driver_median_ms": _medians([d for _, d in rows])}
    return out


def _medians(rows: list[dict[str, float]]) -> dict[str, float]:
    names = list(dict.fromkeys(n for r in rows for n in r))
    return {n: statistics.median(r[n] for r in rows if n in r) for n in names}


def format_hops(report: dict) -> str:
    lines = []
    for kind, r in report.items():
        lines.append(f"{kind}: {r['hops']} hops per step, {r['total_median_ms']:.2f} ms in all (medians of "
                     f"{r['steps']} steps)")
        lines += [f"  {name:<32} {ms:8.2f} ms" for name, ms in r["median_ms"].items()]
        lines += [f"  ({name}: {ms:.2f} ms, not a hop)" for name, ms in r.get("driver_median_ms", {}).items()]
    return "\n".join(lines)
