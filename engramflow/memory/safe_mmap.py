"""Mapped checkpoint files that are rewritten or truncated under us: an error, not SIGBUS.

Touching a page of a file mapping that lies past the file's (new) end raises SIGBUS, and Python
cannot turn that into an exception (the faulting instruction would run again after a Python
handler returned; faulthandler only prints a traceback and dies). So:

* `read_array` makes a private RAM copy of a byte range with pread (never through a mapping):
  a file shortened while it is read gives a short read, reported as `MappedFileChanged`; a
  file modified while it is read (size or mtime changed between the fstat before and after) is
  reported too, so a torn copy is never used. The table server's default (RAM copy) mode loads
  its table this way and is then immune to whatever happens to the file.
* `FileGuard` watches the files behind mmapped arrays through a descriptor of its own (the
  mapped inode, even if the path is later replaced). `check()` is one fstat per file: it
  raises `MappedFileChanged` once a file is shorter than the mapped bytes need or was modified
  (size or mtime changed) since the mapping was made, and keeps raising from then on (a
  rewritten table is never read again, even if it grows back). Call it before each read.

What is left (documented, not hidden): a truncation that lands between `check()` and the
read that follows it (microseconds) still faults; closing that window needs a C-level
sigsetjmp guard or a file lease (fcntl F_SETLEASE, which delays the writer until the lease is
released). A file replaced by rename (the safe way to update a checkpoint) never faults: the
mapping keeps the old inode.
"""
from __future__ import annotations

import os
import weakref

import numpy as np

from engramflow.errors import EngramflowError

_O_READ = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)


class MappedFileChanged(EngramflowError):
    """A mapped (or being-copied) file was truncated or rewritten: its rows can no longer be read."""


def _identity(st: os.stat_result) -> tuple[int, int]:
    return st.st_size, st.st_mtime_ns


def _describe(path, before: tuple[int, int], st: os.stat_result, need: int, during: str = "mapped") -> str:
    size = st.st_size
    if size < need:
        what = f"was truncated to {size} bytes (the table needs {need})"
    elif size != before[0]:
        what = f"changed size from {before[0]} to {size} bytes"
    else:
        what = "was modified"
    return (f"{path} {what} while {during}; its rows are no longer read. Replace checkpoint files by "
            f"rename (never rewrite them in place) and reopen the checkpoint")


class FileGuard:
    """Watches files behind mmapped arrays. `spans`: (path, end offset the arrays need) pairs."""

    def __init__(self, spans):
        self._files: list[tuple[int, str, tuple[int, int], int]] = []
        self.failed: str | None = None
        need: dict[str, int] = {}
        for path, end in spans:
            need[os.fspath(path)] = max(need.get(os.fspath(path), 0), int(end))
        for path, end in need.items():
            try:
                fd = os.open(path, _O_READ)
            except OSError as e:
                self.close()
                raise EngramflowError(f"cannot open {path}: {e.strerror}") from None
            weakref.finalize(self, _close, fd)
            st = os.fstat(fd)
            self._files.append((fd, path, _identity(st), end))
            if st.st_size < end:
                self.failed = _describe(path, _identity(st), st, end)
                raise MappedFileChanged(self.failed)

    def check(self) -> None:
        """Raise MappedFileChanged if any watched file shrank or changed (one fstat per file)."""
        if self.failed is not None:
            raise MappedFileChanged(self.failed)
        for fd, path, ident, need in self._files:
            st = os.fstat(fd)
            if (st.st_size, st.st_mtime_ns) != ident:
                self.failed = _describe(path, ident, st, need)
                raise MappedFileChanged(self.failed)

    def close(self) -> None:
        files, self._files = self._files, []
        for fd, *_ in files:
            _close(fd)


def _close(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


def read_array(path, offset: int, nbytes: int, dtype, shape) -> np.ndarray:
    """A private RAM copy of bytes [offset, offset + nbytes) of `path` as an array, read with
    pread (SIGBUS-safe); MappedFileChanged if the file is too short or changes while read."""
    path = os.fspath(path)
    try:
        fd = os.open(path, _O_READ)
    except OSError as e:
        raise EngramflowError(f"cannot open {path}: {e.strerror}") from None
    try:
        before = os.fstat(fd)
        end = offset + nbytes
        if before.st_size < end:
            raise MappedFileChanged(_describe(path, _identity(before), before, end, "opened"))
        out = np.empty(nbytes, np.uint8)
        view, got = memoryview(out), 0
        while got < nbytes:
            k = os.preadv(fd, [view[got: got + (1 << 30)]], offset + got)
            if k == 0:
                raise MappedFileChanged(_describe(path, _identity(before), os.fstat(fd), end, "read"))
            got += k
        after = os.fstat(fd)
        if _identity(after) != _identity(before):
            raise MappedFileChanged(_describe(path, _identity(before), after, end, "read"))
    except OSError as e:
        raise EngramflowError(f"cannot read {path}: {e.strerror}") from None
    finally:
        os.close(fd)
    return out.view(dtype).reshape(shape)
