"""Host-resident Engram tables: read-only mmaps of the checkpoint's MXFP8 rows.

A row is 256 E4M3 codes + 8 E8M0 scales (264 bytes). Lookups read only the addressed rows
(the table is never expanded), so resident memory does not grow with table size.
"""
from __future__ import annotations

import mmap

import numpy as np
import torch
from tqdm import tqdm

from engramflow.errors import EngramflowError
from engramflow.kernels.mxfp8 import gather_decode
from engramflow.model.checkpoint import Checkpoint, engram_names

_WARM_CHUNK = 64 << 20


class EngramTable:
    """One Engram layer's table."""

    def __init__(self, ckpt: Checkpoint, layer_id: int, advise_random: bool = True):
        self.layer_id = layer_id
        self.columns = ckpt.config.engram_columns
        names = engram_names(layer_id)
        self._names = (names["embed.weight"], names["embed.scale"])
        self._ckpt = ckpt
        self.codes = ckpt.array(self._names[0])  # u8 [rows, head_dim]
        self.scales = ckpt.array(self._names[1])  # u8 [rows, head_dim/32]
        self.rows, self.head_dim = self.codes.shape
        if advise_random:
            # without it, one cold fault pulls megabytes of readahead (DESIGN §4)
            self._advise(mmap.MADV_RANDOM)

    def _advise(self, advice: int) -> None:
        for name in self._names:
            self._ckpt.advise(name, advice)

    def _shape(self, addresses) -> np.ndarray:
        a = np.asarray(addresses)
        if a.ndim != 2 or a.shape[1] != self.columns or not np.issubdtype(a.dtype, np.integer):
            raise EngramflowError(
                f"addresses for layer {self.layer_id} must be integer [T, {self.columns}], got {a.dtype} {list(a.shape)}")
        return a.astype(np.int64, copy=False)

    def gather(self, addresses) -> tuple[np.ndarray, np.ndarray]:
        """Raw rows: codes u8 [T, C, head_dim], scales u8 [T, C, head_dim/32]."""
        a = self._shape(addresses)
        if a.size and (a.min() < 0 or a.max() >= self.rows):  # numpy would wrap negative ones
            bad = a[(a < 0) | (a >= self.rows)][0]
            raise EngramflowError(f"layer {self.layer_id}: address {int(bad)} is outside the table of {self.rows} rows")
        return self.codes[a], self.scales[a]

    def lookup(self, addresses, dtype: torch.dtype = torch.bfloat16, out: torch.Tensor | None = None) -> torch.Tensor:
        """Decoded rows [T, C*head_dim] in column order: the projection's input.
        The gather kernel checks every address against the table (on the hot path, once)."""
        if dtype not in (torch.bfloat16, torch.float32):
            raise EngramflowError(f"lookup dtype must be bfloat16 or float32, got {dtype}")
        try:
            return gather_decode(self.codes, self.scales, self._shape(addresses), dtype, out)
        except EngramflowError as e:
            raise EngramflowError(f"layer {self.layer_id}: {e}") from None

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
