"""The quantised number formats of the checkpoint, decoded exactly (docs/v41.md, "Formats").

* E4M3 (FP8): 1 sign, 4 exponent, 3 mantissa bits; 0x7F/0xFF are NaN, ±448 the largest. To
  float32 by torch's float8 cast, which is exact (subnormals included), with the NaN codes made
  the one NaN the table below holds (the cast keeps their sign and payload).
* E8M0: a bare power of two, 2^(byte - 127); 255 is NaN. One per BLOCK values of a table row
  or of an FP4 weight row; one per 32x32 tile of an FP8 weight (or F32 scales there).
* E2M1 (FP4): two codes a byte, the even element in the low nibble; magnitudes 0..6.

Everything else (table rows, the block-scaled GEMM, activation quantisation) builds on these:
kernels/mxfp8.py decodes Engram table rows, kernels/quant.py holds the V4.1 arithmetic.
"""
from __future__ import annotations

import numpy as np
import torch

from engramflow.errors import EngramflowError

BLOCK = 32  # values per E8M0 scale (table rows, FP4 weights, activation groups) and FP8 tile side
FP8_MAX = 448.0
FP4_MAX = 6.0
# E2M1 magnitudes by code 0..7; codes 8..15 are the negatives
E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                            -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=torch.float32)


def _e4m3_table() -> np.ndarray:
    b = np.arange(256, dtype=np.uint32)
    bits = ((b & 0x80) << 24) | ((b & 0x7F) << 20)
    vals = bits.view(np.float32).astype(np.float64) * 2.0**120
    vals[(b & 0x7F) == 0x7F] = np.nan
    return vals  # float64, exact


E4M3_F64 = _e4m3_table()  # code -> value


def e4m3_to_float32(codes: torch.Tensor) -> torch.Tensor:
    """E4M3 codes (u8 or float8_e4m3fn, any shape, on the CPU or a CUDA device) -> exact float32.
    The cast reads each byte once (3x the speed of moving bits in int32 on the CPU: a real-size
    FP8 weight's 157 M codes take ~1.5 s instead of ~4)."""
    u = codes.view(torch.uint8) if codes.dtype != torch.uint8 else codes
    return u.view(torch.float8_e4m3fn).to(torch.float32).masked_fill_((u & 0x7F) == 0x7F, float("nan"))


def e8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """E8M0 (float8_e8m0fnu or its uint8 bits) -> fp32 powers of two (exact: 2^-127 is an fp32
    subnormal); 255 -> NaN."""
    bits = scale.view(torch.uint8).to(torch.int32)
    out = torch.ldexp(torch.ones_like(bits, dtype=torch.float32), bits - 127)
    return torch.where(bits == 255, torch.nan, out)


# byte -> its two values (low nibble first): one gather a byte instead of one a nibble and a stack
E2M1_PAIRS = torch.stack([E2M1_VALUES[torch.arange(256) & 0x0F], E2M1_VALUES[torch.arange(256) >> 4]], dim=-1)


def e2m1_values(packed: torch.Tensor) -> torch.Tensor:
    """Packed FP4 [..., K/2] (two codes a byte, the even element in the low nibble) -> fp32 [..., K]."""
    return E2M1_PAIRS.to(packed.device)[packed.view(torch.uint8).long()].flatten(-2)


def scales_to_float32(scale: torch.Tensor) -> torch.Tensor:
    """Block scales as float32: E8M0 bytes (u8 / float8_e8m0fnu) -> 2^(s-127), F32 as is."""
    if scale.dtype == torch.uint8 or str(scale.dtype).startswith("torch.float8_e8m0"):
        return e8m0_to_float(scale)
    if not scale.is_floating_point():
        raise EngramflowError(f"block scales must be E8M0 bytes or float, got dtype {scale.dtype}")
    return scale.to(torch.float32)


def block_shape(weight_shape, scale_shape) -> tuple[int, int]:
    """Rows and columns per scale block, from the two shapes (e.g. [128, 128] or [32, 32])."""
    (r, c), (sr, sc) = weight_shape, scale_shape
    if sr < 1 or sc < 1 or r % sr or c % sc:
        raise EngramflowError(f"weight {list(weight_shape)} is not a whole number of scale blocks "
                              f"for scale {list(scale_shape)}")
    return r // sr, c // sc


def dequant_blocks(weight: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Block-scaled FP8 weight [R, C] (u8 or float8_e4m3fn) -> dtype.

    `scale` is [R/br, C/bc] of E8M0 bytes (u8) or float32; the block shape follows from the two
    shapes. E4M3 times a power of two is exact in BF16 for the checkpoint's range.
    """
    vals = e4m3_to_float32(weight)
    if scale is None:
        return vals.to(dtype)
    r, c = vals.shape
    br, bc = block_shape(vals.shape, scale.shape)
    s = scales_to_float32(scale)
    # broadcast each scale over its block without materializing a full-size scale matrix
    vals = vals.view(r // br, br, c // bc, bc).mul_(s[:, None, :, None])
    return vals.view(r, c).to(dtype)
