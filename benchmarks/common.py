"""Shared benchmark plumbing: timing, a printed table and a JSON record."""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path


def tests_oracle(module: str):
    """A reference implementation kept with the tests (e.g. the scalar hashing oracle), as a baseline."""
    import importlib
    import sys

    tests = str(Path(__file__).resolve().parent.parent / "tests")
    if tests not in sys.path:
        sys.path.insert(0, tests)
    return importlib.import_module(module)


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--json", help="write the results here as JSON")
    p.add_argument("--quick", action="store_true", help="a smaller, faster run")
    return p


def args_with_tiny_checkpoint(description: str) -> tuple[argparse.Namespace, Path]:
    """The usual options plus --checkpoint: the tiny checkpoint, made there if missing."""
    from engramflow.model.synth import make_checkpoint

    p = parser(description)
    p.add_argument("--checkpoint", default="checkpoints/tiny", help="made here if missing")
    args = p.parse_args()
    ckpt = Path(args.checkpoint)
    if not (ckpt / "config.json").is_file():
        make_checkpoint("tiny", ckpt)
    return args, ckpt


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


SIMD_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile")


def cpu() -> dict:
    """CPU model and the SIMD flags kernels dispatch on (from /proc/cpuinfo)."""
    model, flags = platform.processor() or "unknown", []
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and model in ("unknown", "", platform.machine()):
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                have = set(line.split(":", 1)[1].split())
                flags = [f for f in SIMD_FLAGS if f in have]
                break
    except OSError:
        pass
    return {"model": model, "flags": flags}


def machine() -> dict:
    return {"cpus": os.cpu_count(), "machine": platform.machine(), "python": platform.python_version(), "cpu": cpu()}


def print_machine() -> None:
    c = cpu()
    print(f"CPU: {c['model']}, {os.cpu_count()} cores, flags: {' '.join(c['flags']) or 'none of interest'}")


def write_json(path: str | None, doc: dict) -> None:
    if path:
        Path(path).write_text(json.dumps(doc | {"machine": machine()}, indent=2))
        print(f"wrote {path}")
