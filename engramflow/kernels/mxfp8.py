"""MXFP8 / FP8 decoding: E4M3 codes with E8M0 (power-of-two) or F32 scales.

E4M3 -> float32 is exact by moving bits: sign to bit 31, exponent+mantissa to bits 20..26,
then scaling by 2^120 (DESIGN §4). Codes 0x7F/0xFF are NaN; E8M0 255 is NaN.
Row decode uses one table indexed by (scale << 8 | code) that already holds
e4m3(code) * 2^(scale-127) in the output dtype, so a bf16 lookup never passes through f32.
"""
from __future__ import annotations

import numpy as np
import torch

BLOCK = 32  # values per E8M0 scale in a table row


def _e4m3_table() -> np.ndarray:
    b = np.arange(256, dtype=np.uint32)
    bits = ((b & 0x80) << 24) | ((b & 0x7F) << 20)
    vals = bits.view(np.float32).astype(np.float64) * 2.0**120
    vals[(b & 0x7F) == 0x7F] = np.nan
    return vals  # float64, exact


E4M3_F64 = _e4m3_table()
E4M3_F32 = E4M3_F64.astype(np.float32)


def e8m0_to_float(scales) -> np.ndarray:
    """E8M0 bytes -> float64 powers of two (255 -> NaN)."""
    s = np.asarray(scales, dtype=np.uint8).astype(np.int64)
    out = np.ldexp(1.0, s - 127)
    return np.where(s == 255, np.nan, out)


def _joint_table(dtype: torch.dtype) -> torch.Tensor:
    """[256 scales * 256 codes] -> e4m3(code) * 2^(scale-127), rounded once into `dtype`."""
    joint = e8m0_to_float(np.arange(256))[:, None] * E4M3_F64[None, :]
    # float64 -> target dtype in one rounding (torch rounds-to-nearest-even)
    return torch.from_numpy(joint.reshape(-1)).to(dtype)


_TABLES: dict[torch.dtype, torch.Tensor] = {}


def joint_table(dtype: torch.dtype) -> torch.Tensor:
    if dtype not in _TABLES:
        _TABLES[dtype] = _joint_table(dtype)
    return _TABLES[dtype]


def decode_rows(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """MXFP8 rows -> values. codes u8 [..., D], scales u8 [..., D/32] -> dtype [..., D]."""
    d = codes.shape[-1]
    idx = (scales.to(torch.int32) << 8).repeat_interleave(BLOCK, dim=-1)
    idx |= codes.to(torch.int32)
    table = joint_table(dtype)
    flat = idx.reshape(-1)
    if out is None:
        return table[flat].reshape(*codes.shape[:-1], d)
    torch.index_select(table, 0, flat, out=out.view(-1))
    return out


def dequant_blocks(weight: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Block-scaled FP8 weight [R, C] (u8 or float8_e4m3fn) -> dtype.

    `scale` is [R/br, C/bc] of E8M0 bytes (u8) or float32; the block shape follows from the two
    shapes. E4M3 times a power of two is exact in BF16 for the checkpoint's range.
    """
    codes = weight.view(torch.uint8) if weight.dtype != torch.uint8 else weight
    r, c = codes.shape
    vals = torch.from_numpy(E4M3_F32)[codes.reshape(-1).long()].reshape(r, c)
    if scale is None:
        return vals.to(dtype)
    sr, sc = scale.shape
    if r % sr or c % sc:
        raise ValueError(f"weight {tuple(codes.shape)} is not a whole number of {tuple(scale.shape)} scale blocks")
    if scale.dtype == torch.uint8 or str(scale.dtype).startswith("torch.float8_e8m0"):
        s = torch.from_numpy(e8m0_to_float(scale.view(torch.uint8).numpy()).astype(np.float32))
    else:
        s = scale.to(torch.float32)
    s = s.repeat_interleave(r // sr, 0).repeat_interleave(c // sc, 1)
    return (vals * s).to(dtype)


def gather_decode(codes: np.ndarray, scales: np.ndarray, addresses: np.ndarray,
                  dtype: torch.dtype = torch.float32, out: torch.Tensor | None = None) -> torch.Tensor:
    """Gather MXFP8 rows by address and decode them in one pass.

    codes: u8 [rows, D] (typically a read-only mmap), scales: u8 [rows, D/32],
    addresses: int64 [T, C]. Returns dtype [T, C*D] in column order: position t's row for
    column c occupies [c*D, (c+1)*D), the layout the projection consumes.
    """
    t, c = addresses.shape
    d = codes.shape[1]
    flat = addresses.reshape(-1)
    idx = (scales[flat].astype(np.int32) << 8)[:, :, None] | codes[flat].reshape(t * c, d // BLOCK, BLOCK)
    table = joint_table(dtype)
    if out is None:
        out = torch.empty(t, c * d, dtype=dtype)
    torch.index_select(table, 0, torch.from_numpy(idx.reshape(-1)), out=out.view(-1))
    return out
