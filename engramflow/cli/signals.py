"""Servers' lives: run until SIGINT/SIGTERM, and stop a server process the way a user would."""
from __future__ import annotations

import signal
import subprocess
import threading


def stop_requested() -> threading.Event:
    """An event SIGINT or SIGTERM sets; install it before the server says it is listening, so
    that a signal sent as soon as a script reads that line is not lost."""
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    return done


def serve_until(done: threading.Event) -> None:
    """Block the main thread until `done` (short waits, so Python runs the signal handlers)."""
    while not done.wait(0.5):
        pass


def interrupt(proc: subprocess.Popen, timeout: float = 60.0) -> None:
    """Stop a server process with SIGINT (it shuts down cleanly); kill it if it takes longer."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
