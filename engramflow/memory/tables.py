"""The one row-store abstraction, and the host-resident Engram tables built on it.

Every place Engram rows live (the host mmap table here; the hot-row cache, SSD, a remote table
server and a stack of them under policies in engramflow.tiers) is a `RowStore`:

* `gather(addresses)` -> codes u8 [*S, D], scales u8 [*S, D/32]: exactly the checkpoint's bytes;
* `lookup(addresses [T, C], dtype)` -> decoded [T, C*D] in column order: the projection's input.

Both check the addresses once, on entry, with `check_addresses`: the only bounds check. Stores
made of other stores (stack, cache) pass the checked ids down through `_fetch` / `_view`, which
never check again.

`lookup` has one decode step for every store: the store gives a *decode view* (row arrays and an
index into them) and the native gather-decode (`kernels.mxfp8.gather_decode`) gathers and
decodes in one pass. The host table's view is the mapped table itself and the addresses (no
copy); a hot cache whose rows all hit gives its resident arrays and slots; any other store gives
the rows it fetched and 0..N-1. Rows kept on another device (a device-resident hot cache) are
decoded there with the same joint table (`kernels.mxfp8.decode_rows`).

Subclasses set `rows`, `head_dim`, `name`, `layer`, `stats` and implement `_gather(ids)`; they may
override `_gather_view` (zero-copy views) and `_gather_tensors` (device-resident rows).

A table row is 256 E4M3 codes + 8 E8M0 scales (264 bytes). Lookups read only the addressed rows
(the table is never expanded), so resident memory does not grow with table size.
"""
from __future__ import annotations

import mmap
from time import perf_counter
from typing import Callable

import numpy as np
import torch
from tqdm import tqdm

from engramflow.errors import EngramflowError
from engramflow.io.checkpoint import Checkpoint, engram_names
from engramflow.kernels.formats import BLOCK
from engramflow.kernels.mxfp8 import decode_rows, gather_decode
from engramflow.memory.safe_mmap import FileGuard

_WARM_CHUNK = 64 << 20


class TierError(EngramflowError):
    """A tier could not answer (connection lost, timeout, server error). Policies act on these."""


class TierUnavailable(TierError):
    """The tier is down or unreachable (as opposed to answering with an error)."""


class AddressError(EngramflowError):
    """An address outside its table: the caller's bug, raised before any tier is asked (no policy
    acts on it)."""


_SMALL = 512  # up to this many ids the builtin max over a memoryview beats a numpy reduction
_LOOKUP_DTYPES = (torch.bfloat16, torch.float32)


def check_addresses(addresses, rows: int, where: str | Callable[[], str] = "") -> np.ndarray:
    """The bounds check: `addresses` (any shape, any integer dtype) as int64, every one in
    [0, rows); else AddressError naming `where` (e.g. "layer 14", or a function giving it, so the
    hot path formats nothing) and the first bad address."""
    a = np.asarray(addresses)
    if a.dtype.kind not in "iu":  # (np.issubdtype costs microseconds on this hot path)
        raise EngramflowError(f"{_where(where)}addresses must be integers, got dtype {a.dtype}")
    a64 = a if a.dtype == np.int64 else a.astype(np.int64)  # u64 past 2^63 wraps negative: caught below
    if a64.size:
        # one unsigned comparison catches both ends (negatives are huge as u64); for the usual
        # few dozen ids the builtin max over the raw buffer is the cheapest way to find the largest
        if a64.size <= _SMALL and a64.flags.c_contiguous:
            hi = max(a64.data.cast("B").cast("Q"))
        else:
            hi = int(a64.reshape(-1).view(np.uint64).max())
        if hi >= rows:
            flat = a64.reshape(-1)
            bad = a.reshape(-1)[(flat < 0) | (flat >= rows)][0]
            raise AddressError(f"{_where(where)}address {int(bad)} is outside the table of {rows} rows")
    return a64


def _where(where) -> str:
    where = where() if callable(where) else where
    return f"{where}: " if where else ""


def _iota(shape) -> np.ndarray:
    return np.arange(int(np.prod(shape)), dtype=np.int64).reshape(shape)


class RowStore:
    """Base class of every row store (see the module docstring)."""

    rows: int
    head_dim: int
    name: str = "store"
    layer: int | None = None
    columns: int | None = None  # when set, lookup() takes exactly [T, columns]
    stats = None  # a TierStats (engramflow.tiers.stats) where counted; None: nothing counted

    @property
    def scale_dim(self) -> int:
        return self.head_dim // BLOCK

    def where(self) -> str:
        """How errors name this store: its layer, else its name."""
        return f"layer {self.layer}" if self.layer is not None else f"{self.name} table"

    # -- public: checked once here ----------------------------------------------------------
    def gather(self, addresses) -> tuple[np.ndarray, np.ndarray]:
        """Raw rows: codes u8 [*S, D], scales u8 [*S, D/32] for integer addresses of shape S."""
        a = check_addresses(addresses, self.rows, self.where)
        codes, scales = self._fetch(a.reshape(-1))
        if a.ndim == 1:
            return codes, scales
        return codes.reshape(*a.shape, self.head_dim), scales.reshape(*a.shape, self.scale_dim)

    def lookup(self, addresses, dtype: torch.dtype = torch.bfloat16, out: torch.Tensor | None = None,
               device: torch.device | str = "cpu") -> torch.Tensor:
        """Decoded rows [T, C*D] in column order (row of column c at [c*D, (c+1)*D)), on `device`."""
        if dtype not in _LOOKUP_DTYPES:
            raise EngramflowError(f"lookup dtype must be bfloat16 or float32, got {dtype}")
        a = np.asarray(addresses)
        if a.ndim != 2 or a.dtype.kind not in "iu" or (self.columns is not None and a.shape[1] != self.columns):
            raise EngramflowError(f"addresses for {self.where()} must be integer [T, {self.columns or 'C'}], "
                                  f"got {a.dtype} {list(a.shape)}")
        a = check_addresses(a, self.rows, self.where)
        if device == "cpu" or torch.device(device).type == "cpu":
            codes, scales, index = self._gather_view(a) if self.stats is None else self._view(a)
            return gather_decode(codes, scales, index, dtype, out)
        codes, scales = self._fetch_tensors(a.reshape(-1), torch.device(device))
        vals = decode_rows(codes, scales, dtype).view(a.shape[0], a.shape[1] * self.head_dim)
        if out is None:
            return vals
        out.copy_(vals)
        return out

    def warmup(self, progress: bool = True) -> None:
        """Fault the rows in, where that means something (the host table); else nothing."""

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- between stores: ids already checked, each call timed and counted -------------------
    def _fetch(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Rows for checked flat int64 ids (what composed stores call on the stores below)."""
        return self._timed(self._gather, ids)

    def _view(self, a: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(codes [R, D], scales [R, D/32], index int64 [T, C] into them) for checked addresses."""
        return self._timed(self._gather_view, a)

    def _fetch_tensors(self, ids: np.ndarray, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        return self._timed(self._gather_tensors, ids, device)

    def _timed(self, fn, ids, *args):
        if self.stats is None:
            return fn(ids, *args)
        t0 = perf_counter()
        try:
            out = fn(ids, *args)
        except TierError:
            self.stats.add("errors")
            raise
        self.stats.record(perf_counter() - t0, ids.size)
        return out

    # -- what subclasses implement ----------------------------------------------------------
    def _gather(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        raise NotImplementedError

    def _gather_view(self, a: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        codes, scales = self._gather(a.reshape(-1))
        return codes, scales, _iota(a.shape)

    def _gather_tensors(self, ids: np.ndarray, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        codes, scales = self._gather(ids)
        return torch.from_numpy(codes).to(device), torch.from_numpy(scales).to(device)


class ArrayRowStore(RowStore):
    """Rows in (mmapped or in-RAM) numpy arrays: `lookup` decodes straight out of them.
    `stats`: a counters object (engramflow.tiers.TierStats) when used as a tier, else None."""

    def __init__(self, codes: np.ndarray, scales: np.ndarray, layer: int | None = None, name: str = "host",
                 stats=None):
        if codes.ndim != 2 or codes.dtype != np.uint8 or codes.shape[1] % BLOCK:
            raise EngramflowError(f"codes must be u8 [rows, k*{BLOCK}], got {codes.dtype} {list(codes.shape)}")
        if scales.dtype != np.uint8 or scales.shape != (codes.shape[0], codes.shape[1] // BLOCK):
            raise EngramflowError(f"scales must be u8 {[codes.shape[0], codes.shape[1] // BLOCK]}, "
                                  f"got {scales.dtype} {list(scales.shape)}")
        self.codes, self.scales = codes, scales
        self.rows, self.head_dim = codes.shape
        self.name, self.layer = name, layer
        self.stats = stats

    def _gather(self, ids):
        # fancy indexing copies the rows out of the mapping: callers own the result
        return self.codes[ids], self.scales[ids]

    def _gather_view(self, a):
        return self.codes, self.scales, a  # the kernel gathers straight from the mapping




class EngramTable(ArrayRowStore):
    """One Engram layer's table (the host store). `stats`: a TierStats when it serves as a tier;
    None for the plain table (nothing but the decode on its hot path)."""

    def __init__(self, ckpt: Checkpoint, layer_id: int, advise_random: bool = True, name: str = "host",
                 stats=None):
        names = engram_names(layer_id)
        self._names = (names["embed.weight"], names["embed.scale"])
        self._ckpt = ckpt
        # codes u8 [rows, head_dim], scales u8 [rows, head_dim/32]
        super().__init__(ckpt.array(self._names[0]), ckpt.array(self._names[1]), layer_id, name, stats)
        self.layer_id = layer_id
        self.columns = ckpt.config.engram_columns
        # a file truncated/rewritten under the mapping: MappedFileChanged, not SIGBUS (safe_mmap.py)
        self._guard = FileGuard((i.file, i.offset + i.nbytes) for i in map(ckpt.info, self._names))
        if advise_random:
            # without it, one cold fault pulls megabytes of readahead (docs/architecture.md, "Storage tiers")
            self._advise(mmap.MADV_RANDOM)

    def _gather(self, ids):
        self._guard.check()
        return super()._gather(ids)

    def _gather_view(self, a):
        self._guard.check()
        return super()._gather_view(a)

    def _advise(self, advice: int) -> None:
        for name in self._names:
            self._ckpt.advise(name, advice)

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes

    def warmup(self, progress: bool = True) -> None:
        """Fault every page in: advise sequential, touch each page, then advise random. No mlock."""
        self._advise(mmap.MADV_SEQUENTIAL)
        arrays = [self.codes.reshape(-1), self.scales.reshape(-1)]
        with tqdm(total=self.nbytes, unit="B", unit_scale=True, disable=not progress,
                  desc=f"warming Engram layer {self.layer_id}") as bar:
            for flat in arrays:
                for start in range(0, flat.shape[0], _WARM_CHUNK):
                    self._guard.check()
                    chunk = flat[start: start + _WARM_CHUNK]
                    int(chunk[::mmap.PAGESIZE].sum())  # one read per page faults it in
                    bar.update(chunk.shape[0])
        self._advise(mmap.MADV_RANDOM)


class EngramTables:
    """All Engram layers of a checkpoint, by layer id."""

    def __init__(self, ckpt: Checkpoint, layer_ids=None):
        ids = ckpt.config.engram_layer_ids if layer_ids is None else layer_ids
        self.layers = {l: EngramTable(ckpt, l) for l in ids}

    def __getitem__(self, layer_id: int) -> EngramTable:
        try:
            return self.layers[layer_id]
        except KeyError:
            raise EngramflowError(f"no Engram table for layer {layer_id} (have {sorted(self.layers)})") from None

    def warmup(self, progress: bool = True) -> None:
        for t in self.layers.values():
            t.warmup(progress)
