"""Collapsed stacks (py-spy's `raw` format) -> flame-graph SVG and speedscope JSON.

py-spy samples each process once; writing both outputs from that one recording halves the
sampling load on a small machine compared with running py-spy twice per actor.
A collapsed line is `root;child;leaf <count>`.
"""
from __future__ import annotations

import hashlib
import html
import re
from pathlib import Path

# Source files of the Engram projection: row lookup, decode and the wkv GEMM (a flame graph's
# share of samples in them is what the projection actor's graph should be made of).
PROJECTION_CODE = r"engramflow/(kernels|memory|tiers)/|engramflow/model/engram_|engramflow/actors/projection_actor"

# A stack whose innermost frame is one of these is a thread waiting, not working: Ray's idle
# worker threads, queue and lock waits, selector loops. Left out of a flame graph by default,
# they would fill it (an actor is idle most of a step) and hide the compute.
IDLE_LEAF = re.compile(r"^(wait|_wait|wait_for|sleep|select|poll|epoll_wait|acquire|_acquire_restore|get|"
                       r"_wait_for_tstate_lock|join|recv|recv_into|accept|main_loop|run_forever|_run_once|"
                       r"get_objects|_worker|do_wait)\b")


def parse_collapsed(text: str) -> list[tuple[list[str], int]]:
    stacks = []
    for line in text.splitlines():
        frames, _, count = line.rstrip().rpartition(" ")
        if frames and count.isdigit():
            stacks.append((frames.split(";"), int(count)))
    return stacks


def frame_function(frame: str) -> str:
    """py-spy's `Class.method (file.py:line)` -> `method`."""
    return frame.split(" (", 1)[0].strip().rsplit(".", 1)[-1]


def is_idle(frames: list[str]) -> bool:
    return not frames or bool(IDLE_LEAF.match(frame_function(frames[-1])))


def drop_idle(stacks):
    """The stacks that are work: those whose innermost frame is not a wait."""
    return [(frames, count) for frames, count in stacks if not is_idle(frames)]


def share(stacks, path_pattern: str) -> float:
    """Fraction of samples with a frame whose source path matches `path_pattern` (a regex)."""
    pattern = re.compile(path_pattern)
    total = sum(c for _, c in stacks)
    hit = sum(c for frames, c in stacks if any(pattern.search(f) for f in frames))
    return hit / total if total else 0.0


class _Node:
    __slots__ = ("name", "count", "children")

    def __init__(self, name: str):
        self.name, self.count, self.children = name, 0, {}


def _tree(stacks) -> _Node:
    root = _Node("all")
    for frames, count in stacks:
        root.count += count
        node = root
        for f in frames:
            node = node.children.setdefault(f, _Node(f))
            node.count += count
    return root


def _colour(name: str) -> str:
    h = hashlib.md5(name.encode()).digest()  # stable colour per function, warm palette
    return f"rgb({200 + h[0] % 55},{80 + h[1] % 120},{40 + h[2] % 50})"


def flamegraph_svg(stacks, title: str, width: int = 1200, row: int = 16) -> str:
    root = _tree(stacks)
    rects: list[str] = []
    depth_max = [0]

    def walk(node: _Node, x: float, depth: int) -> None:
        w = width * node.count / max(root.count, 1)
        if w < 0.3:  # invisible slivers only bloat the file
            return
        depth_max[0] = max(depth_max[0], depth)
        pct = 100.0 * node.count / max(root.count, 1)
        label = html.escape(node.name)
        text = label[: max(0, int(w / 6.5) - 1)] if w > 20 else ""
        rects.append(f'<g><title>{label} ({node.count} samples, {pct:.1f}%)</title>'
                     f'<rect x="{x:.1f}" y="{{y{depth}}}" width="{w:.1f}" height="{row - 1}" '
                     f'fill="{_colour(node.name)}"/>'
                     f'<text x="{x + 3:.1f}" y="{{t{depth}}}" font-size="11">{text}</text></g>')
        cx = x
        for child in sorted(node.children.values(), key=lambda c: c.name):
            walk(child, cx, depth + 1)
            cx += width * child.count / max(root.count, 1)

    walk(root, 0.0, 0)
    top = 30
    height = top + (depth_max[0] + 1) * row + 10
    body = "\n".join(rects)
    for d in range(depth_max[0] + 1):  # root at the bottom, callees above: the classic flame shape
        y = height - 10 - (d + 1) * row
        body = body.replace(f"{{y{d}}}", str(y)).replace(f"{{t{d}}}", str(y + row - 4))
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="monospace">'
            f'<text x="4" y="18" font-size="14">{html.escape(title)} — {root.count} samples</text>\n{body}\n</svg>\n')


def speedscope_json(stacks, name: str) -> dict:
    frames: dict[str, int] = {}
    samples, weights = [], []
    for stack, count in stacks:
        samples.append([frames.setdefault(f, len(frames)) for f in stack])
        weights.append(count)
    return {"$schema": "https://www.speedscope.app/file-format-schema.json", "exporter": "engramflow",
            "name": name, "activeProfileIndex": 0,
            "shared": {"frames": [{"name": f} for f in frames]},
            "profiles": [{"type": "sampled", "name": name, "unit": "none", "startValue": 0,
                          "endValue": sum(weights), "samples": samples, "weights": weights}]}


def convert(raw_path: Path, svg_path: Path, speedscope_path: Path, title: str, idle: bool = False) -> int:
    """Write both outputs (idle stacks left out unless `idle`); returns the number of samples drawn."""
    import json

    stacks = parse_collapsed(raw_path.read_text())
    if not idle:
        recorded = sum(c for _, c in stacks)
        stacks = drop_idle(stacks)
        kept = sum(c for _, c in stacks)
        title += f" — idle/waiting stacks left out: {recorded - kept} of {recorded} samples (--idle keeps them)"
    svg_path.write_text(flamegraph_svg(stacks, title))
    speedscope_path.write_text(json.dumps(speedscope_json(stacks, title)))
    return sum(c for _, c in stacks)
