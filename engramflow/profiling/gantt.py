"""Gantt chart of spans (matplotlib Agg): one row per actor track, time in ms from the start.

Threads of one track (the projection actor runs L1 and L14 side by side) get lanes inside
the track's row so concurrent spans stay visible. Exposed waits are drawn over the stage's
blocks in red: the picture answers "did the backbone ever stop for Engram?" at a glance.
"""
from __future__ import annotations

from pathlib import Path

from engramflow.profiling.trace import span_category, track_sort_key

COLOURS = {"step": "#bbbbbb", "append": "#8c6bb1", "project": "#3182bd", "block": "#74c476", "wait": "#de2d26"}


def pick_window(spans: list[dict], decode_steps: int = 3) -> tuple[int, int]:
    """The first prefill step (its last chunk's neighbours) and the next `decode_steps` decode steps."""
    steps = sorted((s for s in spans if s["track"] == "driver" and s["name"] == "step"), key=lambda s: s["start_ns"])
    if not steps:
        return min(s["start_ns"] for s in spans), max(s["end_ns"] for s in spans)
    first = next((i for i, s in enumerate(steps) if s["args"].get("kind") == "prefill"), 0)
    chosen = [steps[first]]
    chosen += [s for s in steps[first + 1:] if s["args"].get("kind") == "decode"][:decode_steps]
    return chosen[0]["start_ns"], max(s["end_ns"] for s in chosen)


def draw_gantt(spans: list[dict], path: str | Path, window: tuple[int, int] | None = None,
               title: str = "engramflow timeline") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    start, end = window or pick_window(spans)
    shown = [s for s in spans if s["end_ns"] >= start and s["start_ns"] <= end]
    tracks = sorted({s["track"] for s in shown}, key=track_sort_key)
    engram_blocks = {s["name"].split(" L", 1)[1] for s in shown if s["name"].startswith("project L")}
    fig, ax = plt.subplots(figsize=(14, 1.0 + 0.8 * len(tracks)))
    for row, track in enumerate(tracks):
        mine = [s for s in shown if s["track"] == track]
        lanes = sorted({s["tid"] for s in mine})
        height = 0.8 / len(lanes)
        for s in sorted(mine, key=lambda s: span_category(s["name"]) == "wait"):  # waits on top
            kind = span_category(s["name"])
            lane = lanes.index(s["tid"])
            y = row - 0.4 + lane * height
            x0 = (max(s["start_ns"], start) - start) / 1e6
            width = max((min(s["end_ns"], end) - max(s["start_ns"], start)) / 1e6, 0.05)
            ax.broken_barh([(x0, width)], (y, height * 0.9), facecolors=COLOURS.get(kind, "#969696"),
                           edgecolors="white" if kind == "block" else "none", linewidth=0.3)
            label = _label(s, engram_blocks)
            if label and width > (end - start) / 1e6 / 40:  # only where the text fits
                ax.text(x0 + width / 2, y + height * 0.45, label, ha="center", va="center", fontsize=7)
    ax.set_yticks(range(len(tracks)), tracks)
    ax.invert_yaxis()
    ax.set_xlabel("ms since the first step's submit")
    ax.set_title(title)
    ax.legend(handles=[Patch(color=c, label=k) for k, c in COLOURS.items()], loc="upper right", fontsize=8, ncol=5)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _label(span: dict, engram_blocks: set[str]) -> str:
    name = span["name"]
    if name == "step":
        return f"{span['args'].get('kind', '')} {span['args'].get('step', '')}"
    if name.startswith(("project", "wait")):
        return name.split(" ", 1)[1]
    if name.startswith("block "):
        return name.split(" ", 1)[1] if name.split(" ", 1)[1] in engram_blocks else ""
    return name
