"""Shared benchmark plumbing: timing, a printed table and a JSON record."""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--json", help="write the results here as JSON")
    p.add_argument("--quick", action="store_true", help="a smaller, faster run")
    return p


def timed(fn, repeat: int) -> list[float]:
    """Seconds per call, one sample per call."""
    out = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def median(xs) -> float:
    return statistics.median(xs)


def print_table(rows: list[dict], columns: list[str]) -> None:
    cells = [[_fmt(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    for row in cells:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths)))


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 1e4 else f"{v:,.0f}"
    return str(v)


def machine() -> dict:
    return {"cpus": os.cpu_count(), "machine": platform.machine(), "python": platform.python_version()}


def write_json(path: str | None, doc: dict) -> None:
    if path:
        Path(path).write_text(json.dumps(doc | {"machine": machine()}, indent=2))
        print(f"wrote {path}")
