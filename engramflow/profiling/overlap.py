"""Overlap report: per step and Engram layer, how much of the projection the backbone hid.

All times are from the driver's submit of the step (the "step" span of StepTracer):
  projection  how long the projection itself ran (its span)
  ready       submit -> the projection finished (K/V could be handed over)
  window      submit -> the stage started the Engram layer's block (what it could hide behind)
  wait        the exposed wait at that block (the stage's "wait L<n>" span)
  hidden      1 - wait/projection: the part of the projection the backbone overlapped
  placement   "host" (K/V shipped) or "stage" (rows shipped; the stage's projection is in its wait,
              and "projection" is the actor's row gather)
  bytes       Engram bytes that reached the stage for this layer (the stage's "bytes L<n>" span)
Expect wait ≈ max(0, ready - window) plus Ray's hand-over cost (a ray.get of a ready object).
"""
from __future__ import annotations

import dataclasses
import re
import statistics

_PROJECT = re.compile(r"(?:project|rows) L(\d+)$")
_BYTES = re.compile(r"bytes L(\d+)$")
_WAIT = re.compile(r"wait L(\d+)$")


@dataclasses.dataclass
class OverlapRow:
    step: int
    kind: str  # prefill / decode
    tokens: int
    layer: int
    step_ms: float
    projection_ms: float
    ready_ms: float
    window_ms: float
    wait_ms: float
    placement: str = "host"
    bytes: int = 0

    @property
    def hidden_fraction(self) -> float:
        if self.projection_ms <= 0:
            return 1.0
        return min(1.0, max(0.0, 1.0 - self.wait_ms / self.projection_ms))

    def as_dict(self) -> dict:
        return dataclasses.asdict(self) | {"hidden_fraction": self.hidden_fraction}


def _within(spans: list[dict], start: int, end: int) -> list[dict]:
    return [s for s in spans if start <= s["start_ns"] <= end]


def overlap_rows(spans: list[dict]) -> list[OverlapRow]:
    """Spans on one clock (StepTracer.collect) -> one row per (step, Engram layer)."""
    steps = sorted((s for s in spans if s["track"] == "driver" and s["name"] == "step"),
                   key=lambda s: s["start_ns"])
    others = [s for s in spans if s["track"] != "driver"]
    rows = []
    for step in steps:
        t0, t1 = step["start_ns"], step["end_ns"]
        inside = _within(others, t0, t1)
        ms = lambda ns: (ns - t0) / 1e6  # noqa: E731 - a local unit conversion
        for proj in inside:
            m = _PROJECT.match(proj["name"])
            if not m:
                continue
            layer = int(m.group(1))
            # the first request that reaches the block is the one that waits (K/V are cached after)
            block = min((s for s in inside if s["name"] == f"block {layer}"), key=lambda s: s["start_ns"], default=None)
            wait = sum(s["end_ns"] - s["start_ns"] for s in inside
                       if (w := _WAIT.match(s["name"])) and int(w.group(1)) == layer)
            arrived = [s for s in inside if (b := _BYTES.match(s["name"])) and int(b.group(1)) == layer]
            rows.append(OverlapRow(
                step=step["args"].get("step", len(rows)), kind=step["args"].get("kind", "?"),
                tokens=step["args"].get("tokens", 0), layer=layer, step_ms=ms(t1),
                projection_ms=(proj["end_ns"] - proj["start_ns"]) / 1e6, ready_ms=ms(proj["end_ns"]),
                window_ms=ms(block["start_ns"]) if block else float("nan"), wait_ms=wait / 1e6,
                placement="stage" if proj["name"].startswith("rows") else "host",
                bytes=sum(int(s["args"].get("bytes", 0)) for s in arrived)))
    return sorted(rows, key=lambda r: (r.step, r.layer))


COLUMNS = ("step", "kind", "tokens", "layer", "placement", "bytes", "step_ms", "projection_ms", "ready_ms",
           "window_ms", "wait_ms", "hidden_fraction")


def format_table(rows: list[OverlapRow]) -> str:
    cells = [[_fmt(r.as_dict()[c]) for c in COLUMNS] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(COLUMNS)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(COLUMNS, widths))]
    lines += ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def _fmt(v) -> str:
    return f"{v:.2f}" if isinstance(v, float) else str(v)


def summarize(rows: list[OverlapRow]) -> dict:
    """Medians per (kind, layer): the numbers one quotes."""
    groups: dict[str, list[OverlapRow]] = {}
    for r in rows:
        groups.setdefault(f"{r.kind} L{r.layer}", []).append(r)
    return {key: {"steps": len(g), "bytes": sum(r.bytes for r in g),
                  "placement": {p: sum(r.placement == p for r in g) for p in ("host", "stage")},
                  **{f"median_{c}": statistics.median(getattr(r, c) for r in g)
                     for c in ("projection_ms", "ready_ms", "window_ms", "wait_ms", "hidden_fraction")}}
            for key, g in sorted(groups.items())}


def report(rows: list[OverlapRow]) -> dict:
    return {"rows": [r.as_dict() for r in rows], "summary": summarize(rows)}


MEDIAN_COLUMNS = (("steps", "steps", "{:d}"), ("bytes", "Engram bytes", "{:,d}"),
                  ("median_projection_ms", "projection ms", "{:.2f}"), ("median_ready_ms", "K/V ready ms", "{:.2f}"),
                  ("median_window_ms", "window ms", "{:.2f}"), ("median_wait_ms", "exposed wait ms", "{:.2f}"),
                  ("median_hidden_fraction", "hidden", "{:.0%}"))


def format_medians(summary: dict) -> str:
    """`summarize`'s medians as an aligned table, one row per step kind and Engram layer; times
    are medians over the steps, in ms from the step's start (window: when the block that needs
    the K/V began), hidden: the projection's share hidden behind earlier blocks."""
    header = ["step kind / layer"] + [title for _, title, _ in MEDIAN_COLUMNS] + ["placement host/stage"]
    rows = [[key] + [fmt.format(doc[k]) if doc[k] == doc[k] else "n/a" for k, _, fmt in MEDIAN_COLUMNS]
            + [f"{doc['placement']['host']}/{doc['placement']['stage']}"] for key, doc in summary.items()]
    widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
                     for r in [header] + rows)
