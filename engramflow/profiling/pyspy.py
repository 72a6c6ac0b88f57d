"""Attach `py-spy record` to running actor processes for a fixed time, never hanging.

Each actor gets one py-spy subprocess (`--format raw`, converted afterwards into a flame-graph
SVG and speedscope JSON). py-spy records with `--idle` so the raw file has every stack (the
emulated backbone spends its block time in sleep); the graphs leave idle and waiting stacks out
unless asked (flamegraph.drop_idle), so each actor's graph is its compute. `--nonblocking` does not
pause the target, so profiling does not stretch the timeline it is measuring. If py-spy cannot
attach (no ptrace permission, process gone) the result carries a one-line reason; every wait
has a timeout and a stuck py-spy is killed.
"""
from __future__ import annotations

import dataclasses
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from engramflow.profiling.flamegraph import convert

GRACE_S = 20.0  # py-spy needs a moment after --duration to write its output


def pyspy_binary() -> str | None:
    beside = Path(sys.executable).with_name("py-spy")  # the venv's own copy first
    return str(beside) if beside.is_file() else shutil.which("py-spy")


def safe_name(track: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", track).strip("_")


@dataclasses.dataclass
class Recording:
    name: str
    pid: int
    raw: Path
    proc: subprocess.Popen | None
    error: str | None = None


@dataclasses.dataclass
class Profile:
    name: str
    pid: int
    svg: Path | None = None
    speedscope: Path | None = None
    samples: int = 0
    error: str | None = None


def start(targets: dict[str, int], duration_s: float, out_dir: Path, rate: int = 100) -> list[Recording]:
    """Start one py-spy per target (name -> pid); returns at once. Idle stacks are recorded
    (the raw file keeps them); `finish` leaves them out of the graphs unless asked."""
    out_dir.mkdir(parents=True, exist_ok=True)
    exe = pyspy_binary()
    recs = []
    for name, pid in targets.items():
        raw = out_dir / f"{safe_name(name)}.collapsed.txt"
        if exe is None:
            recs.append(Recording(name, pid, raw, None, "py-spy is not installed (pip install py-spy)"))
            continue
        cmd = [exe, "record", "--pid", str(pid), "--duration", str(max(1, round(duration_s))), "--rate", str(rate),
               "--format", "raw", "--idle", "--nonblocking", "--output", str(raw)]
        recs.append(Recording(name, pid, raw, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                                               text=True)))
    return recs


def attach_error(rec: Recording, stderr: str, rc: int) -> str:
    first = next((l.strip() for l in stderr.splitlines() if l.strip()), f"exit status {rc}")
    hint = ""
    if re.search(r"permission|ptrace|operation not permitted|os error 1\b", stderr, re.I):
        hint = " — no ptrace permission: run as root, add CAP_SYS_PTRACE, or set kernel.yama.ptrace_scope=0"
    return f"py-spy could not attach to {rec.name} (pid {rec.pid}): {first}{hint}"


def failed_early(recs: list[Recording], settle_s: float = 1.5) -> list[str]:
    """Give py-spy a moment to attach; mark (and return the reasons of) those that already failed."""
    time.sleep(settle_s)
    for r in recs:
        if r.proc is not None and r.proc.poll() not in (None, 0):
            r.error = attach_error(r, r.proc.stderr.read() or "", r.proc.returncode)
            r.proc = None
    return [r.error for r in recs if r.error]


def finish(recs: list[Recording], duration_s: float, out_dir: Path, idle: bool = False,
           title: str = "") -> list[Profile]:
    deadline = time.monotonic() + duration_s + GRACE_S
    profiles = []
    for rec in recs:
        prof = Profile(rec.name, rec.pid, error=rec.error)
        if rec.proc is not None:
            try:
                _, stderr = rec.proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                rec.proc.kill()
                _, stderr = rec.proc.communicate()
                prof.error = f"py-spy on {rec.name} (pid {rec.pid}) did not finish in time and was stopped"
            else:
                if rec.proc.returncode != 0 or not rec.raw.is_file():
                    prof.error = attach_error(rec, stderr or "", rec.proc.returncode)
        if prof.error is None:
            stem = out_dir / safe_name(rec.name)
            prof.svg, prof.speedscope = stem.with_suffix(".svg"), stem.with_suffix(".speedscope.json")
            prof.samples = convert(rec.raw, prof.svg, prof.speedscope, f"{rec.name} (pid {rec.pid}){title}", idle)
        profiles.append(prof)
    return profiles
