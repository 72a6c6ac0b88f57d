"""Quiet by default: Ray's own output goes to a log file, the command's own lines to the terminal.

Ray writes from Python log handlers that look `sys.stderr` up when they write, from Python
warnings, and from its C++ core worker straight to file descriptor 2; Ray Data adds progress bars
per operator. Unless `--verbose` is given, `quiet_ray` points descriptor 2 at a log file for the
length of the command, turns Ray Data's progress bars off, and makes `sys.stderr` a router:
what a log handler or the warnings module writes goes to the file, everything else (the
command's own messages and its one progress bar) to the terminal. `starting_ray`
prints the one line a user sees before Ray's start-up silence, naming that file.
"""
from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
import tempfile
import warnings
from pathlib import Path

_log_path: Path | None = None  # the file Ray's output goes to while a command runs quietly
_restore: list = []  # undo steps run when the command ends


def log_dir() -> Path:
    """Beside Ray's own session logs (Ray's temporary folder, `RAY_TMPDIR` or /tmp/ray)."""
    return Path(os.environ.get("RAY_TMPDIR") or Path(tempfile.gettempdir()) / "ray") / "engramflow"


@contextlib.contextmanager
def quiet_ray(verbose: bool):
    try:
        with _quiet(verbose):
            yield
    finally:
        while _restore:
            _restore.pop()()


@contextlib.contextmanager
def _quiet(verbose: bool):
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
    old_stderr = sys.stderr
    terminal = io.TextIOWrapper(os.fdopen(terminal_fd, "wb", buffering=0), write_through=True,
                                encoding=old_stderr.encoding, errors="backslashreplace")
    log = io.TextIOWrapper(os.fdopen(os.dup(2), "wb", buffering=0), write_through=True, encoding="utf-8",
                           errors="backslashreplace")
    sys.stderr = _Router(terminal, log)
    _log_path = path
    try:
        yield
    finally:
        _log_path = None
        sys.stderr = old_stderr
        terminal.flush()
        os.dup2(terminal.fileno(), 2)  # the terminal back on descriptor 2
        terminal.close()
        log.close()


def _is_real_stderr() -> bool:
    try:
        return sys.stderr is sys.__stderr__ and sys.stderr.fileno() == 2
    except (AttributeError, OSError, ValueError):
        return False


_TO_LOG = {os.path.normcase(logging.__file__), os.path.normcase(warnings.__file__)}


class _Router:
    """sys.stderr while quiet: writes made by a log handler or by the warnings module go to the
    log file, all others to the terminal (the caller's file decides; no buffering of its own)."""

    def __init__(self, terminal, log):
        self._terminal, self._log = terminal, log

    def write(self, text: str) -> int:
        caller = os.path.normcase(sys._getframe(1).f_code.co_filename)
        return (self._log if caller in _TO_LOG else self._terminal).write(text)

    def flush(self) -> None:
        self._terminal.flush()
        self._log.flush()

    def __getattr__(self, name):  # fileno, isatty, encoding...: the terminal's (progress bars ask)
        return getattr(self._terminal, name)


def starting_ray(what: str = "a local Ray instance") -> None:
    """Arrange for one line before Ray's start-up (seconds of silence): what starts and where its
    logs go. Printed when `ray.init` is called, so a command that refuses its input first (after
    this call) prints nothing more than its error; lasts until the command ends."""
    import ray

    if ray.is_initialized() or getattr(ray.init, "_engramflow_announces", False):
        return
    real_init = ray.init

    def init(*args, **kwargs):
        ray.init = real_init  # once
        if not ray.is_initialized():
            where = f"; Ray's log lines go to {_log_path} (--verbose shows them)" if _log_path else ""
            target = "Ray at " + str(kwargs["address"]) if kwargs.get("address") else what
            print(f"engramflow: starting {target}…{where}", file=sys.stderr, flush=True)
        return real_init(*args, **kwargs)

    init._engramflow_announces = True
    ray.init = init
    _restore.append(lambda: setattr(ray, "init", real_init))
