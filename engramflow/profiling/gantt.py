"""Gantt chart of spans (matplotlib Agg): one row per actor track, time in ms.

Two panels when the run has both: one prefill chunk, and the first few decode steps after it
(a prefill chunk is tens of times longer than a decode step, so one shared axis would hide the
decode steps). Concurrent spans of one track (the projection actor runs L1 and L14 side by
side) are packed into lanes inside the track's row. Exposed waits are drawn over the stage's
blocks in red: the picture answers "did the backbone ever stop for Engram?" at a glance.
"""
from __future__ import annotations

from pathlib import Path

from engramflow.profiling.trace import span_category, track_sort_key

COLOURS = {"step": "#bbbbbb", "append": "#8c6bb1", "project": "#3182bd", "block": "#74c476", "wait": "#de2d26"}
Window = tuple[int, int]


def _steps(spans: list[dict]) -> list[dict]:
    return sorted((s for s in spans if s["track"] == "driver" and s["name"] == "step"), key=lambda s: s["start_ns"])


def pick_windows(spans: list[dict], decode_steps: int = 3) -> list[tuple[str, Window]]:
    """(title, window) for the first prefill chunk and for the `decode_steps` decode steps after it."""
    steps = _steps(spans)
    if not steps:
        return [("all spans", (min(s["start_ns"] for s in spans), max(s["end_ns"] for s in spans)))]
    windows = []
    first = next((i for i, s in enumerate(steps) if s["args"].get("kind") == "prefill"), None)
    if first is not None:
        s = steps[first]
        windows.append((f"prefill chunk (step {s['args'].get('step')}, {s['args'].get('tokens')} tokens)",
                        (s["start_ns"], s["end_ns"])))
    decodes = [s for s in steps[(first or 0):] if s["args"].get("kind") in ("decode", "verify")][:decode_steps]
    if decodes:
        windows.append((f"{len(decodes)} {decodes[0]['args']['kind']} steps", (decodes[0]["start_ns"], decodes[-1]["end_ns"])))
    return windows


def _lanes(spans: list[dict]) -> dict[int, int]:
    """Greedy interval packing: id(span) -> lane. Waits sit on their block, so lane 0."""
    ends: list[int] = []
    lane_of = {}
    for s in sorted(spans, key=lambda s: s["start_ns"]):
        if span_category(s["name"]) == "wait":
            lane_of[id(s)] = 0
            continue
        lane = next((i for i, e in enumerate(ends) if e <= s["start_ns"]), len(ends))
        if lane == len(ends):
            ends.append(0)
        ends[lane] = s["end_ns"]
        lane_of[id(s)] = lane
    return lane_of


def _panel(ax, spans: list[dict], window: Window, tracks: list[str], title: str) -> None:
    start, end = window
    span_ms = (end - start) / 1e6
    for row, track in enumerate(tracks):
        mine = [s for s in spans if s["track"] == track and s["end_ns"] >= start and s["start_ns"] <= end
                and s["name"] != "call"]  # a stage call encloses its blocks: drawn, it would only add a lane
        lane_of = _lanes(mine)
        height = 0.8 / (max(lane_of.values(), default=0) + 1)
        for s in sorted(mine, key=lambda s: span_category(s["name"]) == "wait"):  # waits on top
            kind = span_category(s["name"])
            y = row - 0.4 + lane_of[id(s)] * height
            x0 = (max(s["start_ns"], start) - start) / 1e6
            width = max((min(s["end_ns"], end) - max(s["start_ns"], start)) / 1e6, span_ms / 2000)
            ax.broken_barh([(x0, width)], (y, height * 0.9), facecolors=COLOURS.get(kind, "#969696"),
                           edgecolors="white" if kind == "block" else "none", linewidth=0.3)
            label = _label(s)
            if label and width > span_ms / 30:  # only where the text fits
                ax.text(x0 + width / 2, y + height * 0.45, label, ha="center", va="center", fontsize=7)
    ax.set_yticks(range(len(tracks)), tracks)
    ax.set_ylim(len(tracks) - 0.5, -0.5)
    ax.set_xlim(0, span_ms)
    ax.set_xlabel("ms since the submit of the panel's first step")
    ax.set_title(title, fontsize=10)
    ax.grid(axis="x", alpha=0.3)


def draw_gantt(spans: list[dict], path: str | Path, windows: list[tuple[str, Window]] | None = None,
               title: str = "engramflow timeline") -> Path:
    from matplotlib.figure import Figure  # no pyplot: the caller's backend stays as it is
    from matplotlib.patches import Patch

    windows = windows or pick_windows(spans)
    tracks = sorted({s["track"] for s in spans}, key=track_sort_key)
    fig = Figure(figsize=(14, 0.6 + len(windows) * (0.9 + 0.7 * len(tracks))))
    axes = fig.subplots(len(windows), 1, squeeze=False)
    for ax, (sub, window) in zip(axes[:, 0], windows):
        _panel(ax, spans, window, tracks, sub)
    fig.suptitle(title)
    fig.legend(handles=[Patch(color=c, label=k) for k, c in COLOURS.items()], loc="upper right", fontsize=8, ncol=5)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path


def _label(span: dict) -> str:
    name = span["name"]
    if name == "step":
        return f"{span['args'].get('kind', '')} {span['args'].get('step', '')}"
    if name.startswith(("project", "wait")):
        return name.split(" ", 1)[1]
    if name == "append":
        return name
    return ""  # 40 blocks per step: labels would only be noise
