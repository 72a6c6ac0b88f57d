"""SSD tier: rows read in place from the checkpoint file, a whole request at queue depth.

An SSD serves pages, and random reads cost latency and IOPS, not bandwidth (docs/architecture.md, "Storage tiers"). So a
request's rows are deduplicated and coalesced by page (read_plan.py), and every read of the
request (of several tables at once with `gather_many`: both layers, all sessions of a step)
is submitted together and completed together by a `BatchReader` (io_uring from our C, or a
pool of pread threads; io/batch_read.py).

Scales resident: a row's 8 E8M0 scale bytes live in another tensor than its 256 codes, so a
cold row would cost two page reads. With `scales="resident"` (the default) the scale tensor
(8 B per row: ~3 GB per released table) is copied into RAM at open and a cold row is one read;
`scales="read"` reads them from the file too (their pages are coalesced the same way).

Page cache: this tier exists to *not* hold the table in RAM, so reads bypass the page cache
where the OS allows: `direct` (O_DIRECT; aligned reads into page-aligned buffers), `dontneed`
(buffered reads, pages dropped with POSIX_FADV_DONTNEED afterwards), `buffered`; `auto` takes
the first that works here and `mode_reason` says why one was passed over.

A read that fails or comes back short is a TierError naming the layer, the row and the bytes,
so the tier stack's policy (fallback / retry / reject) acts on it.
"""
from __future__ import annotations

import os
import threading

import numpy as np

from engramflow.errors import EngramflowError
from engramflow.io.batch_read import ENGINES, OPEN_MODES, AlignedBuffer, BatchReader, open_for_reads
from engramflow.memory.safe_mmap import read_array
from engramflow.tiers.read_plan import ReadPlan, plan_reads
from engramflow.tiers.source import RowStore, TierError
from engramflow.tiers.stats import LatencyHistogram, TierStats

MODES = OPEN_MODES
SCALES = ("resident", "read")
IO_COUNTERS = ("batches", "ids", "distinct_rows", "reads", "pages")


class SsdSource(RowStore):
    """Rows of one table from `path`: codes at byte `codes_offset` ([rows, D]), scales at `scales_offset`.

    `queue_depth`: reads kept in flight; `engine`: auto | uring | threads; `readers`: threads of
    the thread engine (default: queue_depth); `mode`: page-cache mode; `scales`: resident | read.
    """

    io_bound = True  # lookups wait on a device: worth overlapping with compute (prefetch.py)

    def __init__(self, path, codes_offset: int, scales_offset: int, rows: int, head_dim: int,
                 readers: int | None = None, mode: str = "auto", layer: int | None = None, name: str = "ssd", *,
                 queue_depth: int = 64, engine: str = "auto", scales: str = "resident", scales_path=None):
        if mode not in MODES:
            raise EngramflowError(f"SSD read mode must be one of {', '.join(MODES)}, got {mode!r}")
        if readers is not None and (isinstance(readers, bool) or not isinstance(readers, int)
                                    or not 1 <= readers <= 256):
            raise EngramflowError(f"SSD readers must be an integer in [1, 256], got {readers!r}")
        if scales not in SCALES:
            raise EngramflowError(f"SSD scales must be one of {', '.join(SCALES)}, got {scales!r}")
        if engine not in ENGINES:
            raise EngramflowError(f"SSD I/O engine must be one of {', '.join(ENGINES)}, got {engine!r}")
        self.path = os.fspath(path)
        self.rows, self.head_dim = rows, head_dim
        self.codes_offset, self.scales_offset = codes_offset, scales_offset
        self.scales_path = os.fspath(scales_path) if scales_path is not None else self.path
        if scales == "read" and self.scales_path != self.path:
            raise EngramflowError(f"SSD scales='read' needs codes and scales in one file, got {self.path} and "
                                  f"{self.scales_path} (use scales='resident')")
        for p, off, rb, what in ((self.path, codes_offset, head_dim, "codes"),
                                 (self.scales_path, scales_offset, head_dim // 32, "scales")):
            size = os.path.getsize(p)
            if off < 0 or off + rows * rb > size:
                raise EngramflowError(f"{p}: {what} [{rows} x {rb}] at byte {off} run past the file's {size} bytes")
        self.name, self.layer = name, layer
        self.stats = TierStats(name, layer)
        self.read_latency = LatencyHistogram()  # one sample per device read
        self._lock = threading.Lock()
        self.io_counts = dict.fromkeys(IO_COUNTERS, 0)
        self._fd = None
        self.reader = BatchReader(queue_depth, engine, threads=readers)
        try:
            self._fd, self.mode, self.mode_reason = open_for_reads(self.path, mode)
            self.resident_scales = (read_array(self.scales_path, scales_offset, rows * self.scale_dim, np.uint8,
                                               (rows, self.scale_dim)) if scales == "resident" else None)
        except BaseException:
            self.close()
            raise
        self.queue_depth, self.engine, self.scales = queue_depth, self.reader.engine, scales
        self.readers = readers or queue_depth

    @classmethod
    def from_checkpoint(cls, ckpt, layer: int, readers: int | None = None, mode: str = "auto", name: str = "ssd",
                        **kw):
        from engramflow.io.checkpoint import engram_names
        n = engram_names(layer)
        ci, si = ckpt.info(n["embed.weight"]), ckpt.info(n["embed.scale"])
        if ci.file != si.file and kw.get("scales", "resident") == "read":
            # reading scales too would need a second descriptor; the official shards keep a table's pair together
            raise EngramflowError(f"layer {layer}: codes ({ci.file.name}) and scales ({si.file.name}) are in "
                                  "different shards; scales='read' needs them in one file (use scales='resident')")
        return cls(ci.file, ci.offset, si.offset, ci.shape[0], ci.shape[1], readers, mode, layer, name,
                   scales_path=si.file, **kw)

    def io_stats(self) -> dict:
        """Counters (batches, ids asked, distinct rows, reads, pages) and the dedup ratio."""
        with self._lock:
            c = dict(self.io_counts)
        c["dedup_ratio"] = c["ids"] / c["distinct_rows"] if c["distinct_rows"] else 1.0
        c["rows_per_read"] = c["distinct_rows"] / c["reads"] if c["reads"] else 0.0
        c.update(engine=self.engine, mode=self.mode, queue_depth=self.queue_depth, scales=self.scales)
        return c

    def _gather(self, ids):
        return gather_many([(self, ids)])[0]

    def close(self) -> None:
        reader, self.reader = getattr(self, "reader", None), None
        if reader is not None:
            reader.close()
        if getattr(self, "_fd", None) is not None:
            os.close(self._fd)
            self._fd = None


_buffers = threading.local()  # one aligned buffer per calling thread (L1 and L14 look up concurrently)


def _buffer(nbytes: int) -> AlignedBuffer:
    buf = getattr(_buffers, "buf", None)
    if buf is None:
        buf = _buffers.buf = AlignedBuffer(nbytes)
    buf.ensure(nbytes)
    return buf


def gather_many(requests) -> list[tuple[np.ndarray, np.ndarray]]:
    """Rows for several (SsdSource, checked flat int64 ids) pairs with all their reads submitted
    at once through the first source's reader: [(codes [N, D], scales [N, D/32]), ...]."""
    if not requests:
        return []
    plans: list[tuple[SsdSource, ReadPlan, ReadPlan | None]] = []
    for src, ids in requests:
        if src.reader is None:
            raise TierError(f"{src.where()}: SSD tier {src.name!r} is closed")
        rows, inverse = np.unique(np.asarray(ids, np.int64).reshape(-1), return_inverse=True)
        pc = plan_reads(None, src.codes_offset, src.head_dim, rows=rows, inverse=inverse)
        ps = None if src.resident_scales is not None else plan_reads(
            None, src.scales_offset, src.scale_dim, rows=rows, inverse=inverse)
        plans.append((src, pc, ps))
    parts = [p for _, pc, ps in plans for p in (pc, ps) if p is not None]
    fds = np.concatenate([np.full(p.reads, src._fd, np.int32) for src, pc, ps in plans
                          for p in (pc, ps) if p is not None])
    starts = np.cumsum([0] + [p.buffer_bytes for p in parts])
    offsets = np.concatenate([p.offsets for p in parts])
    lengths = np.concatenate([p.lengths for p in parts])
    buf_off = np.concatenate([p.buffer_offsets + s for p, s in zip(parts, starts)])
    buf = _buffer(int(starts[-1]))
    reader = requests[0][0].reader
    try:
        results, lat = reader.read(fds, offsets, lengths, buf.address + buf_off.astype(np.uint64))
    except OSError as e:
        src = requests[0][0]
        raise TierError(f"{src.where()}: SSD tier {src.name!r}: the batch of {offsets.size} reads failed: {e}") from e
    out, k, j = [], 0, 0
    for src, pc, ps in plans:
        got = []
        for p in (pc, ps):
            if p is None:
                continue
            s = starts[j]
            _check(src, p, results[k:k + p.reads], offsets[k:k + p.reads])
            _account(src, p, lat[k:k + p.reads] if lat is not None else None)
            got.append(p.take(buf.array[s:s + p.buffer_bytes]))
            k, j = k + p.reads, j + 1
        codes = got[0]
        scales = src.resident_scales[pc.rows] if ps is None else got[1]
        with src._lock:
            c = src.io_counts
            c["batches"] += 1
            c["ids"] += pc.inverse.size
            c["distinct_rows"] += pc.rows.size
        out.append((codes[pc.inverse], scales[pc.inverse]))
    return out


def _check(src: SsdSource, plan: ReadPlan, results: np.ndarray, offsets: np.ndarray) -> None:
    bad = np.flatnonzero(results < plan.needed)
    if not bad.size:
        return
    r = int(bad[0])
    row = int(plan.rows[np.flatnonzero(plan.row_read == r)[0]])
    what = (f"failed: {os.strerror(-int(results[r]))} (errno {-int(results[r])})" if results[r] < 0 else
            f"came back short: {int(results[r])} of the {int(plan.needed[r])} bytes needed (file truncated?)")
    more = f" ({bad.size} of {plan.reads} reads failed)" if bad.size > 1 else ""
    raise TierError(f"{src.where()}: SSD read of row {row} (bytes {int(offsets[r])}+{int(plan.lengths[r])} of "
                    f"{src.path}) {what}{more}")


def _account(src: SsdSource, plan: ReadPlan, lat_ns) -> None:
    if src.mode == "dontneed":
        for off, n in zip(plan.offsets.tolist(), plan.lengths.tolist()):
            os.posix_fadvise(src._fd, off, n, os.POSIX_FADV_DONTNEED)
    with src._lock:
        src.io_counts["reads"] += plan.reads
        src.io_counts["pages"] += int(plan.lengths.sum()) // 4096
        if lat_ns is not None:
            src.read_latency.add_many(lat_ns / 1e9)
