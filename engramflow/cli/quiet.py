"""Quiet by default: Ray's own output goes to a log file, the command's own lines to the terminal.

Ray writes from Python loggers bound to the stderr of import time, from Python warnings, and
from its C++ core worker straight to file descriptor 2; Ray Data adds progress bars per operator.
Unless `--verbose` is given, `quiet_ray` points descriptor 2 at a log file for the length of the
command and gives `sys.stderr` (what the command's own messages and its one progress bar use) a
fresh handle on the real terminal, so every one of Ray's paths lands in the file. `starting_ray`
prints the one line a user sees before Ray's start-up silence, naming that file.
"""
from __future__ import annotations

import contextlib
import io
import os
import sys
import tempfile
import warnings
from pathlib import Path

_log_path: Path | None = None  # the file Ray's output goes to while a command runs quietly


def log_dir() -> Path:
    """Beside Ray's own session logs (Ray's temporary folder, `RAY_TMPDIR` or /tmp/ray)."""
    return Path(os.environ.get("RAY_TMPDIR") or Path(tempfile.gettempdir()) / "ray") / "engramflow"


@contextlib.contextmanager
def quiet_ray(verbose: bool):
    global _log_path
    if verbose:
        yield
        return
    os.environ.setdefault("RAY_DATA_DISABLE_PROGRESS_BARS", "1")  # read when ray.data is imported
    if "ray.data" in sys.modules:
        sys.modules["ray.data"].DataContext.get_current().enable_progress_bars = False
    if not _is_real_stderr():  # e.g. captured by a test harness: leave it be
        yield
        return
    path = log_dir() / f"engramflow-{os.getpid()}.log"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        log_fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    except OSError:  # nowhere to put the logs: leave them on the terminal
        yield
        return
    sys.stderr.flush()
    terminal_fd = os.dup(2)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    old_stderr, old_showwarning = sys.stderr, warnings.showwarning
    sys.stderr = io.TextIOWrapper(os.fdopen(terminal_fd, "wb", buffering=0), write_through=True,
                                  encoding=old_stderr.encoding, errors="backslashreplace")
    warnings.showwarning = _warning_to_log
    _log_path = path
    try:
        yield
    finally:
        _log_path = None
        warnings.showwarning = old_showwarning
        sys.stderr.flush()
        os.dup2(sys.stderr.fileno(), 2)  # the terminal back on descriptor 2
        sys.stderr.close()
        sys.stderr = old_stderr


def _is_real_stderr() -> bool:
    try:
        return sys.stderr is sys.__stderr__ and sys.stderr.fileno() == 2
    except (AttributeError, OSError, ValueError):
        return False


def _warning_to_log(message, category, filename, lineno, file=None, line=None):
    with open(os.dup(2), "a", closefd=True) as log:  # descriptor 2 is the log file now
        log.write(warnings.formatwarning(message, category, filename, lineno, line))


def starting_ray(what: str = "a local Ray instance") -> None:
    """The line before Ray's start-up (seconds of silence): what starts and where its logs go."""
    import ray

    if ray.is_initialized():
        return
    where = f"; Ray's log lines go to {_log_path} (--verbose shows them)" if _log_path else ""
    print(f"engramflow: starting {what}…{where}", file=sys.stderr, flush=True)
