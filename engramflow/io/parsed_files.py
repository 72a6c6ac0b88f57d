"""Objects built from a file, kept for the file's next reader in this process.

Parsing the 129k-token `tokenizer.json` costs ~0.25 CPU-s, and the serving text built on it
(a plain-text copy of the tokenizer, the longest token) over a second. A process that opens
the same checkpoint again (an Engine per run, a replica's backend, a test suite) builds them
once. The key is the file's bytes (a digest), not its name or time stamp: a file rewritten
within the clock's granularity, or under another name, is never mistaken for another. Reading
and hashing the file costs a few milliseconds. What is kept is shared by every caller, which
must not change it (a tokenizer's truncation, padding or added tokens, for one).
"""
from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

MAX_KEPT = 8  # a handful of checkpoints' tokenizers; each is tens of MB

_kept: OrderedDict = OrderedDict()
_lock = threading.Lock()


def parsed(path: Path, kind: str, build: Callable[[Path], object]):
    """`build(path)`, or what it returned before for a file with the same bytes. `kind` names
    what is built, so that two builders of one file keep apart."""
    key = (kind, hashlib.blake2b(Path(path).read_bytes(), digest_size=20).digest())
    with _lock:
        if key in _kept:
            _kept.move_to_end(key)
            return _kept[key]
    value = build(path)  # outside the lock: a slow build does not hold up readers of other files
    with _lock:
        _kept[key] = value
        while len(_kept) > MAX_KEPT:
            _kept.popitem(last=False)
    return value


def forget() -> None:
    """Drop everything kept (the memory, or a test that wants a fresh build)."""
    with _lock:
        _kept.clear()
