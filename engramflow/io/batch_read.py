"""Many small positional reads in flight at once: the SSD tier's I/O engine.

An SSD's random-read cost is latency and IOPS, not bandwidth; reads issued one after another
pay the latency each time, while a device serves dozens of reads in parallel. `BatchReader`
takes a whole batch of (fd, offset, length, buffer) reads and keeps up to `queue_depth` of
them in flight until all are done:

* `uring`: io_uring through raw syscalls in our own C (kernels/native_io.c), one ring per
  calling thread; the call releases the GIL;
* `threads`: a pool of `queue_depth` threads, each doing blocking preads (os.preadv releases
  the GIL) on its share of the batch.

`auto` takes uring when the library loads and the kernel grants a ring, else threads;
`engine_reason` says why a fallback happened. `open_for_reads` opens a file with O_DIRECT
where the filesystem supports it (tmpfs does not), probing with a real aligned read.
"""
from __future__ import annotations

import ctypes
import errno
import mmap
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from engramflow.errors import EngramflowError
from engramflow.validate import check_int

PAGE = 4096  # O_DIRECT alignment used for offsets, lengths and buffers (a page is always enough)
ENGINES = ("auto", "uring", "threads")
OPEN_MODES = ("auto", "direct", "dontneed", "buffered")
MAX_QUEUE_DEPTH = 4096


class AlignedBuffer:
    """A growable page-aligned anonymous mapping (O_DIRECT needs aligned buffers)."""

    def __init__(self, nbytes: int = PAGE):
        self._map = None
        self.ensure(nbytes)

    def ensure(self, nbytes: int) -> np.ndarray:
        """The buffer as u8, at least `nbytes` long (grows by doubling; old contents are dropped)."""
        if self._map is None or len(self._map) < nbytes:
            size = max(PAGE, -(-max(nbytes, 2 * len(self._map) if self._map is not None else 0) // PAGE) * PAGE)
            self._map = mmap.mmap(-1, size)
            self.array = np.frombuffer(self._map, np.uint8)
            self.address = self.array.ctypes.data
        return self.array


def open_for_reads(path, mode: str = "auto") -> tuple[int, str, str]:
    """(fd, mode in use, why a fallback happened or ''). `mode`: direct (O_DIRECT), dontneed
    (buffered reads, pages dropped afterwards), buffered, or auto (the first that works)."""
    if mode not in OPEN_MODES:
        raise EngramflowError(f"read mode must be one of {', '.join(OPEN_MODES)}, got {mode!r}")
    path = os.fspath(path)
    reasons = []
    for m in (("direct", "dontneed", "buffered") if mode == "auto" else (mode,)):
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | (_o_direct() if m == "direct" else 0))
        except OSError as e:
            if mode != "auto" or m != "direct":
                raise EngramflowError(f"{path}: cannot open for {m} reads: {e.strerror}") from None
            reasons.append(f"O_DIRECT open fails ({e.strerror})")
            continue
        except AttributeError:  # no O_DIRECT on this OS
            if mode != "auto":
                raise EngramflowError(f"{path}: O_DIRECT does not exist on this OS") from None
            reasons.append("no O_DIRECT on this OS")
            continue
        try:
            if m == "direct":
                buf = AlignedBuffer(PAGE)
                os.preadv(fd, [memoryview(buf._map)[:PAGE]], 0)  # tmpfs accepts the flag but fails reads
            elif m == "dontneed":
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # no readahead around each row
            return fd, m, "; ".join(reasons)
        except (OSError, AttributeError) as e:
            os.close(fd)
            why = getattr(e, "strerror", None) or str(e)
            if mode != "auto":
                raise EngramflowError(f"{path}: {m} reads fail here: {why}") from None
            reasons.append(f"{m} reads fail on this filesystem ({why})")
    raise EngramflowError(f"{path}: no read mode works ({'; '.join(reasons)})")


def _o_direct() -> int:
    return os.O_DIRECT  # AttributeError where the OS has none


class BatchReader:
    """Reads batches of byte ranges with up to `queue_depth` in flight (module docstring)."""

    def __init__(self, queue_depth: int = 64, engine: str = "auto", threads: int | None = None):
        if engine not in ENGINES:
            raise EngramflowError(f"I/O engine must be one of {', '.join(ENGINES)}, got {engine!r}")
        check_int("queue depth", queue_depth, 1, MAX_QUEUE_DEPTH)
        self.queue_depth = queue_depth
        self.threads = threads or queue_depth  # of the thread engine
        self._local = threading.local()
        self._rings: list[int] = []
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._lib = None
        self.engine, self.engine_reason = "threads", ""
        if engine in ("auto", "uring"):
            why = self._try_uring()
            if why:
                if engine == "uring":
                    raise EngramflowError(f"io_uring engine unavailable: {why}")
                self.engine_reason = f"io_uring unavailable ({why}); a pool of {self.threads} pread threads instead"
            else:
                self.engine = "uring"

    def _try_uring(self) -> str:
        if os.environ.get("ENGRAMFLOW_NO_URING") == "1":
            return "disabled by ENGRAMFLOW_NO_URING=1"
        from engramflow.kernels import native_io
        lib = native_io.library()
        if lib is None:
            return native_io.why_not()
        self._lib = lib
        try:
            self._ring()  # the kernel may refuse (sysctl io_uring_disabled, seccomp, old kernel)
        except OSError as e:
            self._lib = None
            return f"the kernel refuses a ring: {e.strerror}"
        return ""

    def _ring(self) -> int:
        ring = getattr(self._local, "ring", None)
        if ring is None:
            err = ctypes.c_int(0)
            ring = self._lib.efio_ring_open(max(self.queue_depth, 1), ctypes.byref(err))
            if not ring:
                raise OSError(err.value, os.strerror(err.value))
            with self._lock:
                if self._rings is None:  # closed meanwhile
                    self._lib.efio_ring_close(ring)
                    raise EngramflowError("the batch reader is closed")
                self._rings.append(ring)
            self._local.ring = ring
        return ring

    def read(self, fds, offsets, lengths, addresses, timed: bool = True) -> tuple[np.ndarray, np.ndarray | None]:
        """Read i: lengths[i] bytes at offsets[i] of fds[i] into memory at addresses[i] (which
        must stay alive). Returns (bytes read or -errno, per read; latency ns per read or None)."""
        n = len(offsets)
        fds = np.ascontiguousarray(np.broadcast_to(np.asarray(fds, np.int32), (n,)))
        offsets = np.ascontiguousarray(offsets, np.int64)
        lengths = np.ascontiguousarray(np.broadcast_to(np.asarray(lengths, np.int64), (n,)))
        addresses = np.ascontiguousarray(addresses, np.uint64)
        results = np.zeros(n, np.int64)
        lat = np.zeros(n, np.int64) if timed else None
        if n == 0:
            return results, lat
        if self.engine == "uring":
            rc = self._lib.efio_ring_read(self._ring(), fds.ctypes.data, n, offsets.ctypes.data, lengths.ctypes.data,
                                          addresses.ctypes.data, self.queue_depth, 0, results.ctypes.data,
                                          lat.ctypes.data if timed else None)
            if rc < 0:
                raise OSError(-rc, f"io_uring_enter failed: {os.strerror(-rc)}")
            return results, lat
        self._read_threads(fds, offsets, lengths, addresses, results, lat)
        return results, lat

    def _read_threads(self, fds, offsets, lengths, addresses, results, lat) -> None:
        n = len(offsets)
        groups = min(self.threads, n)
        if groups == 1:
            _pread_range(0, n, fds, offsets, lengths, addresses, results, lat)
            return
        if self._pool is None:
            with self._lock:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="batch-read")
        # interleaved shares: each thread takes every groups-th read, so all start at once
        futs = [self._pool.submit(_pread_range, g, n, fds, offsets, lengths, addresses, results, lat, groups)
                for g in range(groups)]
        for f in futs:
            f.result()

    def close(self) -> None:
        with self._lock:
            rings, self._rings = self._rings, None
            pool, self._pool = self._pool, None
        for ring in rings or ():
            self._lib.efio_ring_close(ring)
        if pool is not None:
            pool.shutdown(wait=True)


def _pread_range(start, n, fds, offsets, lengths, addresses, results, lat, step: int = 1) -> None:
    import time
    for i in range(start, n, step):
        view = memoryview((ctypes.c_char * int(lengths[i])).from_address(int(addresses[i]))).cast("B")
        t0 = time.perf_counter_ns() if lat is not None else 0
        try:
            results[i] = os.preadv(int(fds[i]), [view], int(offsets[i]))
        except OSError as e:
            results[i] = -(e.errno or errno.EIO)
        if lat is not None:
            lat[i] = time.perf_counter_ns() - t0
