"""The row-source interface every storage tier implements, the host-mmap tier, and an adapter
that makes any source look like an `EngramTable` to the projection.

A source answers `gather(row_ids[N]) -> (codes u8 [N, D], scales u8 [N, D/32])` with exactly the
bytes the checkpoint holds; tiers differ only in where the bytes come from and how fast.
"""
from __future__ import annotations

import time

import numpy as np
import torch

from engramflow.errors import EngramflowError
from engramflow.kernels.mxfp8 import BLOCK, decode_rows, joint_table
from engramflow.tiers.stats import TierStats


class TierError(EngramflowError):
    """A tier could not answer (connection lost, timeout, server error). Policies act on these."""


class TierUnavailable(TierError):
    """The tier is down or unreachable (as opposed to answering with an error)."""


def check_row_ids(row_ids, rows: int, what: str = "table") -> np.ndarray:
    """Row ids as a flat int64 array, every one in [0, rows), else an error naming the first bad one."""
    a = np.asarray(row_ids)
    if a.dtype.kind not in "iu":  # (np.issubdtype costs microseconds on this hot path)
        raise EngramflowError(f"row ids must be integers, got dtype {a.dtype}")
    a = a.reshape(-1).astype(np.int64, copy=False)
    # one unsigned comparison catches both ends: negatives wrap to huge values
    if a.size and int(a.view(np.uint64).max()) >= rows:
        bad = a[(a < 0) | (a >= rows)][0]
        raise EngramflowError(f"row id {int(bad)} is outside the {what} of {rows} rows")
    return a


class RowSource:
    """Base class: subclasses set `rows`, `head_dim`, `name`, `stats` and implement `_gather`."""

    rows: int
    head_dim: int
    name: str = "source"
    stats: TierStats

    @property
    def scale_dim(self) -> int:
        return self.head_dim // BLOCK

    def gather(self, row_ids) -> tuple[np.ndarray, np.ndarray]:
        """codes u8 [N, D], scales u8 [N, D/32] for the flat row ids (bounds-checked first)."""
        ids = check_row_ids(row_ids, self.rows, f"{self.name} table")
        t0 = time.perf_counter()
        try:
            out = self._gather(ids)
        except TierError:
            self.stats.add("errors")
            raise
        self.stats.record(time.perf_counter() - t0, ids.size)
        return out

    def _gather(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        raise NotImplementedError

    def gather_tensors(self, row_ids, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """The same bytes as torch u8 tensors on `device` (a device-resident cache overrides this)."""
        codes, scales = self.gather(row_ids)
        return torch.from_numpy(codes).to(device), torch.from_numpy(scales).to(device)

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class HostMmapSource(RowSource):
    """The existing host store: rows read straight out of (mmapped or in-RAM) numpy arrays."""

    def __init__(self, codes: np.ndarray, scales: np.ndarray, layer: int | None = None, name: str = "host"):
        if codes.ndim != 2 or codes.dtype != np.uint8 or codes.shape[1] % BLOCK:
            raise EngramflowError(f"codes must be u8 [rows, k*{BLOCK}], got {codes.dtype} {list(codes.shape)}")
        if scales.dtype != np.uint8 or scales.shape != (codes.shape[0], codes.shape[1] // BLOCK):
            raise EngramflowError(f"scales must be u8 {[codes.shape[0], codes.shape[1] // BLOCK]}, "
                                  f"got {scales.dtype} {list(scales.shape)}")
        self.codes, self.scales = codes, scales
        self.rows, self.head_dim = codes.shape
        self.name, self.layer = name, layer
        self.stats = TierStats(name, layer)

    @classmethod
    def from_table(cls, table, name: str = "host") -> "HostMmapSource":
        """Wrap an `engramflow.memory.tables.EngramTable` (keeps its MADV_RANDOM mapping)."""
        return cls(table.codes, table.scales, table.layer_id, name)

    @classmethod
    def from_checkpoint(cls, ckpt, layer: int, name: str = "host") -> "HostMmapSource":
        from engramflow.memory.tables import EngramTable
        return cls.from_table(EngramTable(ckpt, layer), name)

    def _gather(self, ids):
        # fancy indexing copies the rows out of the mapping: callers own the result
        return self.codes[ids], self.scales[ids]


class SourceTable:
    """`EngramTable`'s lookup interface over any RowSource, so a tier stack can feed the projection.

    `lookup` returns [T, C*D] in column order, the layout `gather_decode` produces.
    """

    def __init__(self, source: RowSource, layer_id: int, columns: int = 24):
        self.source, self.layer_id, self.columns = source, layer_id, columns
        self.rows, self.head_dim = source.rows, source.head_dim

    def _check(self, addresses) -> np.ndarray:
        a = np.asarray(addresses)
        if a.ndim != 2 or a.shape[1] != self.columns or not np.issubdtype(a.dtype, np.integer):
            raise EngramflowError(f"addresses for layer {self.layer_id} must be integer [T, {self.columns}], "
                                  f"got {a.dtype} {list(a.shape)}")
        return a

    def gather(self, addresses) -> tuple[np.ndarray, np.ndarray]:
        """Raw rows: codes u8 [T, C, D], scales u8 [T, C, D/32] (one source call for all T*C rows)."""
        a = self._check(addresses)
        codes, scales = self.source.gather(a.reshape(-1))
        t = a.shape[0]
        return codes.reshape(t, self.columns, -1), scales.reshape(t, self.columns, -1)

    def lookup(self, addresses, dtype: torch.dtype = torch.bfloat16, out: torch.Tensor | None = None,
               device: torch.device | str = "cpu") -> torch.Tensor:
        """Decoded rows [T, C*D] on `device` (the decode runs where the rows are)."""
        a = self._check(addresses)
        codes, scales = self.source.gather_tensors(a.reshape(-1), device)
        vals = _decode(codes, scales, dtype)  # [T*C, D]
        vals = vals.view(a.shape[0], self.columns * self.head_dim)
        if out is None:
            return vals
        out.copy_(vals)
        return out


_DEVICE_TABLES: dict[tuple[str, torch.dtype], torch.Tensor] = {}


def _decode(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """decode_rows, with its lookup table copied once to the rows' device when that is not the CPU."""
    if codes.device.type == "cpu":
        return decode_rows(codes, scales, dtype)
    key = (str(codes.device), dtype)
    if key not in _DEVICE_TABLES:
        _DEVICE_TABLES[key] = joint_table(dtype).to(codes.device)
    idx = (scales.to(torch.int32) << 8).repeat_interleave(BLOCK, dim=-1) | codes.to(torch.int32)
    return _DEVICE_TABLES[key][idx.reshape(-1)].reshape(codes.shape)
