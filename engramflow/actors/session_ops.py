"""Session operations on an actor's component, idempotent, and reconciliation to the driver's log.

The driver's session log is the one source of truth (pipeline/runner.py): it validates every
open/fork/reset/close, records it, and only then sends it to the actors. A send may be repeated
after a fault (it may have reached some actors before another died), so every operation is
idempotent here: an open of a session that exists empties it, a close of a missing session is
a no-op, a fork replaces a half-made copy. After a fault the driver reconciles each stateful
actor to its log with `sync_sessions` (close what the log no longer has, empty or open what it
has) and replays the log's writes, so whatever an interrupted operation left behind is undone.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
import time
from collections.abc import Callable, Iterable

OPS = ("open", "fork", "reset", "close", "truncate")  # truncate: (session, length), a rejected draft


def apply_session_op(component, has: Callable[[str], bool], op: str, args: tuple) -> None:
    """Apply `op` to `component` (SessionHistory, BackboneStage) so that sending it twice has the
    effect of sending it once (a resend after a fault is harmless)."""
    if op not in OPS:
        raise ValueError(f"unknown session op {op!r}")
    if op == "open" and has(args[0]):
        op = "reset"
    elif op == "close" and not has(args[0]):
        return
    elif op == "fork" and has(args[1]):
        component.close(args[1])
    getattr(component, op)(*args)


def sync_sessions(component, present: Iterable[str], wanted: Iterable[str]) -> dict:
    """Make `component` hold exactly the `wanted` sessions, each empty (the driver replays their
    writes next): close the others, empty the ones it has, open the ones it lacks."""
    wanted = list(dict.fromkeys(wanted))
    keep = set(wanted)
    present = list(present)
    closed = [s for s in present if s not in keep]
    for s in closed:
        component.close(s)
    have = set(present)
    opened = []
    for s in wanted:
        if s in have:
            component.reset(s)
        else:
            component.open(s)
            opened.append(s)
    return {"closed": closed, "opened": opened}


_libc = None


def release_memory(collect: bool = True) -> None:
    """Collect garbage (`collect`) and hand freed heap pages back to the OS (glibc keeps freed
    chunks, so an actor's RSS would otherwise stay at its peak after its sessions close)."""
    global _libc
    if os.environ.get("ENGRAMFLOW_RELEASE_MEMORY", "1") == "0":  # off: to measure what it saves
        return
    if collect:
        gc.collect()
    if _libc is None:
        try:
            _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _libc.malloc_trim  # noqa: B018 (glibc only)
        except (OSError, AttributeError):
            _libc = False
    if _libc:
        _libc.malloc_trim(0)


def freeze_long_lived() -> None:
    """Move every object alive now (at the end of an actor's constructor: modules, weights,
    tokenizer) out of the cyclic collector's sight, as they live as long as the actor. A full
    collection then walks only what came later: 0 ms instead of ~125 ms in a stage with the
    tokenizer and torch loaded. Without it the full collection after the last session closed
    ran in every stateful actor, one after another, inside the next request's first step
    (+0.5 s TTFT on the serving benchmark's first load). Reference counting still frees them."""
    gc.collect()
    gc.freeze()


def rss_bytes() -> int:
    """This process's resident set size (VmRSS), 0 where /proc is not there."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class MemoryReleaser:
    """When to call release_memory after sessions close: a trim whenever the last one closes
    and every `every` closes; a full garbage collection with it at most every `gc_every_s`
    seconds. (A full gc.collect costs 80-250 ms in an actor that holds a tokenizer and torch,
    unless the actor froze its startup heap (`freeze_long_lived`, as the stateful actors do);
    a job that opens and closes a session per prompt would pay it per prompt, or stall the
    pipeline every 16 prompts. Session state is freed by reference counting when it closes;
    the trim gives the pages back.)"""

    def __init__(self, every: int = 16, on_empty: Callable[[], None] | None = None, gc_every_s: float = 30.0):
        self.every = every
        self.on_empty = on_empty
        self.gc_every_s = gc_every_s
        self._closes = 0
        self._last_gc = float("-inf")

    def closed(self, live_sessions: int) -> bool:
        self._closes += 1
        if live_sessions == 0 or self._closes >= self.every:
            self._closes = 0
            if live_sessions == 0 and self.on_empty is not None:
                self.on_empty()
            now = time.monotonic()
            full = now - self._last_gc >= self.gc_every_s
            if full:
                self._last_gc = now
            release_memory(collect=full)
            return True
        return False
