"""SSD tier: rows read from the checkpoint file with positional reads by a pool of reader threads.

An SSD serves whole pages and random-read latency, not bandwidth, decides (DESIGN §4), so each
row costs two small reads (its codes and its scales live in different tensors) and the reads of
one request are spread over `readers` threads (os.pread releases the GIL).

Page cache: the point of this tier is *not* to keep the table in RAM, so reads bypass the page
cache where the OS allows: `direct` opens with O_DIRECT and reads whole aligned blocks into
page-aligned buffers; `dontneed` uses normal preads and drops the pages afterwards with
POSIX_FADV_DONTNEED; `buffered` is plain pread. `auto` tries them in that order.
"""
from __future__ import annotations

import mmap
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from engramflow.errors import EngramflowError
from engramflow.tiers.source import RowStore, TierError
from engramflow.tiers.stats import LatencyHistogram, TierStats

MODES = ("auto", "direct", "dontneed", "buffered")
_ALIGN = 4096  # O_DIRECT needs offset, length and buffer aligned to the logical block; a page always is


class SsdSource(RowStore):
    """Rows of one table from `path`: codes at byte `codes_offset` ([rows, D]), scales at `scales_offset`."""

    def __init__(self, path, codes_offset: int, scales_offset: int, rows: int, head_dim: int,
                 readers: int = 4, mode: str = "auto", layer: int | None = None, name: str = "ssd"):
        if mode not in MODES:
            raise EngramflowError(f"SSD read mode must be one of {', '.join(MODES)}, got {mode!r}")
        if not (isinstance(readers, int) and 1 <= readers <= 256):
            raise EngramflowError(f"SSD readers must be an integer in [1, 256], got {readers!r}")
        self.path = os.fspath(path)
        self.rows, self.head_dim = rows, head_dim
        self._offsets = (codes_offset, scales_offset)
        self._row_bytes = (head_dim, head_dim // 32)
        size = os.path.getsize(self.path)
        for off, rb, what in ((codes_offset, head_dim, "codes"), (scales_offset, head_dim // 32, "scales")):
            if off < 0 or off + rows * rb > size:
                raise EngramflowError(f"{self.path}: {what} [{rows} x {rb}] at byte {off} run past the file's {size} bytes")
        self.name, self.layer = name, layer
        self.stats = TierStats(name, layer)
        self.read_latency = LatencyHistogram()  # one sample per pread: the device's own latency
        self._lat_lock = threading.Lock()
        self._local = threading.local()  # each reader thread owns one aligned buffer
        self.mode = self._open(mode)
        self.read_latency = LatencyHistogram()  # drop the probe read of _open
        self.readers = readers
        self._pool = ThreadPoolExecutor(readers, thread_name_prefix=f"ssd-{layer}") if readers > 1 else None

    @classmethod
    def from_checkpoint(cls, ckpt, layer: int, readers: int = 4, mode: str = "auto", name: str = "ssd"):
        from engramflow.io.checkpoint import engram_names
        n = engram_names(layer)
        ci, si = ckpt.info(n["embed.weight"]), ckpt.info(n["embed.scale"])
        if ci.file != si.file:
            # two files would need two descriptors; the official shards keep a table's pair together
            raise EngramflowError(f"layer {layer}: codes ({ci.file.name}) and scales ({si.file.name}) are in "
                                  "different shards; the SSD tier needs them in one file")
        return cls(ci.file, ci.offset, si.offset, ci.shape[0], ci.shape[1], readers, mode, layer, name)

    def _open(self, mode: str) -> str:
        """Open the file in the first mode that works here; returns the mode in use."""
        for m in (("direct", "dontneed", "buffered") if mode == "auto" else (mode,)):
            try:
                flags = os.O_RDONLY | (os.O_DIRECT if m == "direct" else 0)
                fd = os.open(self.path, flags)
            except (OSError, AttributeError) as e:  # no O_DIRECT on this OS / filesystem
                if mode != "auto":
                    raise EngramflowError(f"{self.path}: cannot open for {m} reads: {e}") from None
                continue
            self._fd, self.mode = fd, m
            try:
                if m == "direct":
                    self._read(0, 1)  # tmpfs and some filesystems accept the flag but fail reads
                elif m == "dontneed":
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # no readahead around each row
                return m
            except (OSError, AttributeError) as e:
                os.close(fd)
                if mode != "auto":
                    raise EngramflowError(f"{self.path}: {m} reads fail here: {e}") from None
        raise EngramflowError(f"{self.path}: no read mode works")  # buffered always opens if the file does

    def _buffer(self) -> mmap.mmap:
        buf = getattr(self._local, "buf", None)
        if buf is None:
            # anonymous maps are page-aligned; room for a row straddling block boundaries
            buf = self._local.buf = mmap.mmap(-1, (-(-self.head_dim // _ALIGN) + 1) * _ALIGN)
        return buf

    def _read(self, off: int, n: int) -> bytes:
        """`n` bytes at file offset `off`, in the open mode; times the read."""
        t0 = time.perf_counter()
        if self.mode == "direct":
            start = off - off % _ALIGN
            length = -(-(off + n - start) // _ALIGN) * _ALIGN
            buf = self._buffer()
            got = os.preadv(self._fd, [memoryview(buf)[:length]], start)
            if got < off + n - start:
                raise OSError(f"short read at byte {off}")
            data = buf[off - start: off - start + n]
        else:
            data = os.pread(self._fd, n, off)
            if len(data) < n:
                raise OSError(f"short read at byte {off}")
            if self.mode == "dontneed":
                os.posix_fadvise(self._fd, off, n, os.POSIX_FADV_DONTNEED)
        dt = time.perf_counter() - t0
        with self._lat_lock:
            self.read_latency.add(dt)
        return data

    def _read_rows(self, uniq: np.ndarray, codes: np.ndarray, scales: np.ndarray) -> None:
        (co, so), (cb, sb) = self._offsets, self._row_bytes
        for i, r in enumerate(uniq.tolist()):
            codes[i] = np.frombuffer(self._read(co + r * cb, cb), np.uint8)
            scales[i] = np.frombuffer(self._read(so + r * sb, sb), np.uint8)

    def _gather(self, ids):
        uniq, inverse = np.unique(ids, return_inverse=True)  # a row read twice costs two device reads
        codes = np.empty((uniq.size, self.head_dim), np.uint8)
        scales = np.empty((uniq.size, self.scale_dim), np.uint8)
        try:
            if self._pool is None or uniq.size < 2:
                self._read_rows(uniq, codes, scales)
            else:
                parts = np.array_split(np.arange(uniq.size), min(self.readers, uniq.size))
                futs = [self._pool.submit(self._read_rows, uniq[p], codes[p[0]:p[-1] + 1], scales[p[0]:p[-1] + 1])
                        for p in parts]
                for f in futs:
                    f.result()
        except OSError as e:
            raise TierError(f"{self.path}: SSD read failed: {e}") from e
        return codes[inverse], scales[inverse]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        if getattr(self, "_fd", None) is not None:
            os.close(self._fd)
            self._fd = None
