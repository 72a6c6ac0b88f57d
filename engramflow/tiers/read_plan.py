"""Which device reads a batch of row ids needs: one per distinct row, one per page run.

Rows are fixed-size records at `base + row * row_bytes` of a file. A request's ids are
deduplicated (a row asked for by several positions, sessions or heads is read once), then the
distinct rows' byte ranges are mapped to 4 KiB pages and rows that share a page go into one
read (a row that straddles a page boundary joins the reads of both its pages into one). Reads
are page-aligned in offset and length, as O_DIRECT requires, and land back to back in one
buffer. Pure numpy, no I/O: `ReadPlan` says where every read goes and where every row is.
"""
from __future__ import annotations

import dataclasses

import numpy as np

PAGE = 4096


@dataclasses.dataclass(frozen=True)
class ReadPlan:
    rows: np.ndarray         # distinct row ids, ascending [U]
    inverse: np.ndarray      # index into `rows` of every requested id [N]
    offsets: np.ndarray      # file offset of each read, page-aligned [R]
    lengths: np.ndarray      # bytes of each read, whole pages [R]
    needed: np.ndarray       # bytes of each read that hold wanted rows (a read past EOF may stop short of `lengths`) [R]
    buffer_offsets: np.ndarray  # where each read lands in the buffer [R]
    row_read: np.ndarray     # the read holding each distinct row [U]
    row_pos: np.ndarray      # byte position of each distinct row in the buffer [U]
    row_bytes: int

    @property
    def buffer_bytes(self) -> int:
        return int(self.lengths.sum())

    @property
    def reads(self) -> int:
        return int(self.offsets.size)

    def take(self, buffer: np.ndarray) -> np.ndarray:
        """The distinct rows out of the filled buffer: u8 [U, row_bytes]."""
        return buffer[self.row_pos[:, None] + np.arange(self.row_bytes)]

    def counts(self) -> dict:
        return {"ids": int(self.inverse.size), "distinct_rows": int(self.rows.size), "reads": self.reads,
                "pages": int(self.lengths.sum()) // PAGE}


def plan_reads(ids, base: int, row_bytes: int, page: int = PAGE, rows: np.ndarray | None = None,
               inverse: np.ndarray | None = None) -> ReadPlan:
    """The reads for `ids` (flat int64, already bounds-checked) of records of `row_bytes` at
    byte `base`. `rows`/`inverse`: a deduplication already made (np.unique of ids)."""
    if rows is None:
        rows, inverse = np.unique(np.asarray(ids, np.int64).reshape(-1), return_inverse=True)
    starts = base + rows * row_bytes
    first = starts // page
    last = (starts + row_bytes - 1) // page
    if rows.size == 0:
        e = np.zeros(0, np.int64)
        return ReadPlan(rows, inverse, e, e, e, e, e, e, row_bytes)
    # rows ascending, equal sizes: `last` never decreases, so a row opens a new read exactly
    # when its first page lies past the previous row's last page
    new = np.empty(rows.size, bool)
    new[0] = True
    new[1:] = first[1:] > last[:-1]
    row_read = np.cumsum(new) - 1
    opens = np.flatnonzero(new)
    closes = np.append(opens[1:], rows.size) - 1
    offsets = first[opens] * page
    lengths = (last[closes] - first[opens] + 1) * page
    needed = starts[closes] + row_bytes - offsets
    buffer_offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    row_pos = buffer_offsets[row_read] + (starts - offsets[row_read])
    return ReadPlan(rows, inverse.reshape(-1), offsets, lengths, needed, buffer_offsets, row_read, row_pos,
                    row_bytes)
