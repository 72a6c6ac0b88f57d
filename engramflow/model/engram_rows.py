"""The rows payload: a step's gathered Engram rows exactly as the table stores them (MXFP8).

What a projection actor ships when the stage projects (`projection="stage"`): per position the
24 addressed rows of one layer, 256 E4M3 codes + 8 E8M0 scales each (264 B; 6,336 B per token
per layer at the released shapes), against 25,600 fp32 K/V values (102,400 B) when the host
projects. Rows travel as stored, not decoded: BF16-decoded rows would be 4x the bytes
(12,288 B per token) and decoding is a table lookup any device does at memory speed. The stage
decodes them with the same joint table (`kernels.mxfp8`) the host lookup uses, so its
projection input is bit-identical to the host's.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import torch

from engramflow.errors import EngramflowError
from engramflow.kernels.formats import BLOCK
from engramflow.kernels.mxfp8 import decode_rows, gather_decode


@dataclasses.dataclass
class EngramRows:
    """codes u8 [T, C, D], scales u8 [T, C, D/32] of one Engram layer for a step's T positions."""
    codes: np.ndarray
    scales: np.ndarray

    def __post_init__(self):
        c, s = self.codes, self.scales
        if (c.ndim != 3 or c.dtype != np.uint8 or s.dtype != np.uint8 or c.shape[2] % BLOCK
                or s.shape != (*c.shape[:2], c.shape[2] // BLOCK)):
            raise EngramflowError(f"Engram rows must be codes u8 [T, C, D] and scales u8 [T, C, D/{BLOCK}], got "
                                  f"{c.dtype} {list(c.shape)} and {s.dtype} {list(s.shape)}")

    @property
    def tokens(self) -> int:
        return self.codes.shape[0]

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes

    def decode(self, dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu") -> torch.Tensor:
        """[T, C*D] in column order: what `RowStore.lookup` gives for the same addresses (same bits)."""
        t, c, d = self.codes.shape
        if torch.device(device).type == "cpu":
            codes = np.ascontiguousarray(self.codes).reshape(t * c, d)
            scales = np.ascontiguousarray(self.scales).reshape(t * c, d // BLOCK)
            index = np.arange(t * c, dtype=np.int64).reshape(t, c)
            return gather_decode(codes, scales, index, dtype)
        codes = torch.from_numpy(np.ascontiguousarray(self.codes)).to(device)
        scales = torch.from_numpy(np.ascontiguousarray(self.scales)).to(device)
        return decode_rows(codes, scales, dtype).view(t, c * d)


def kv_nbytes(key, value) -> int:
    """Bytes of a projected (key, value) pair as shipped (numpy arrays or tensors)."""
    size = (lambda a: a.nbytes) if isinstance(key, np.ndarray) else (lambda a: a.numel() * a.element_size())
    return int(size(key) + size(value))
