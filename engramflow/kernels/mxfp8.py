"""MXFP8 / FP8 decoding: E4M3 codes with E8M0 (power-of-two) or F32 scales.

E4M3 -> float32 is exact by moving bits: sign to bit 31, exponent+mantissa to bits 20..26,
then scaling by 2^120 (DESIGN §4). Codes 0x7F/0xFF are NaN; E8M0 255 is NaN.

Every decoded value is e4m3(code) * 2^(scale-127) rounded once into the output dtype (exact
in float32; bfloat16 rounds only where the power of two over- or underflows it). NaNs come
out as the canonical positive quiet NaN of the dtype.

Two implementations of the row decode give identical bits: the native kernel
(native_kernels.c, built on first use) and a numpy/torch path that uses one lookup table
indexed by (scale << 8 | code), already holding the rounded value in the output dtype.
"""
from __future__ import annotations

import weakref

import numpy as np
import torch

from engramflow.errors import EngramflowError
from engramflow.kernels import native

BLOCK = 32  # values per E8M0 scale in a table row
_NAN_BITS = {torch.float32: 0x7FC00000, torch.bfloat16: 0x7FC0, torch.float16: 0x7E00}
_BITS_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


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


def _canonical_nan(t: torch.Tensor) -> torch.Tensor:
    """Replace every NaN by the dtype's positive quiet NaN (torch's f64->bf16 cast makes 0xFFFF)."""
    nan = torch.tensor(_NAN_BITS[t.dtype], dtype=torch.int32).to(_BITS_VIEW[t.dtype]).view(t.dtype)
    return torch.where(torch.isnan(t), nan, t)


def _joint_table(dtype: torch.dtype) -> torch.Tensor:
    """[256 scales * 256 codes] -> e4m3(code) * 2^(scale-127), rounded once into `dtype`."""
    joint = e8m0_to_float(np.arange(256))[:, None] * E4M3_F64[None, :]
    # float64 -> target dtype in one rounding (torch rounds-to-nearest-even)
    return _canonical_nan(torch.from_numpy(joint.reshape(-1)).to(dtype))


_TABLES: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def joint_table(dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """The one decode table, built once per dtype on the CPU and copied once to any other device."""
    device = torch.device(device)
    key = (dtype, device)
    if key not in _TABLES:
        _TABLES[key] = _joint_table(dtype) if device.type == "cpu" else joint_table(dtype).to(device)
    return _TABLES[key]


def decode_rows(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """MXFP8 rows -> values. codes u8 [..., D], scales u8 [..., D/32] -> dtype [..., D], decoded on
    the rows' device (a device's copy of the joint table is made once)."""
    d = codes.shape[-1]
    idx = (scales.to(torch.int32) << 8).repeat_interleave(BLOCK, dim=-1)
    idx |= codes.to(torch.int32)
    table = joint_table(dtype, codes.device)
    flat = idx.reshape(-1)
    if out is None:
        return table[flat].reshape(*codes.shape[:-1], d)
    torch.index_select(table, 0, flat, out=out.view(-1))
    return out


def e4m3_to_float32(codes: torch.Tensor) -> torch.Tensor:
    """E4M3 codes (u8 or float8_e4m3fn, any shape) -> exact float32 by the bit trick."""
    b = (codes.view(torch.uint8) if codes.dtype != torch.uint8 else codes).to(torch.int32)
    vals = (((b & 0x80) << 24) | ((b & 0x7F) << 20)).view(torch.float32) * 2.0**120
    return vals.masked_fill_((b & 0x7F) == 0x7F, float("nan"))


def scales_to_float32(scale: torch.Tensor) -> torch.Tensor:
    """Block scales as float32: E8M0 bytes (u8 / float8_e8m0fnu) -> 2^(s-127), F32 as is."""
    if scale.dtype == torch.uint8 or str(scale.dtype).startswith("torch.float8_e8m0"):
        raw = scale.view(torch.uint8).cpu().numpy()
        return torch.from_numpy(e8m0_to_float(raw).astype(np.float32))
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


def _ptr(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


# Per-call Python overhead dominates a 24-row gather (~2 µs of C work), and reading a numpy
# array's data pointer costs ~3 µs here, so the table's pointers are looked up once per
# (codes, scales) pair and remembered while both arrays are alive.
_TABLE_INFO: dict[tuple[int, int], tuple] = {}


def _table_info(codes, scales) -> tuple | None:
    """(codes ptr, row stride, scales ptr, row stride, rows, D) when the native kernel can read it."""
    key = (id(codes), id(scales))
    hit = _TABLE_INFO.get(key)
    if hit is not None and hit[0]() is codes and hit[1]() is scales:
        return hit[2]
    ok = (isinstance(codes, np.ndarray) and isinstance(scales, np.ndarray)
          and codes.dtype == np.uint8 and scales.dtype == np.uint8 and codes.ndim == 2 and scales.ndim == 2
          and codes.strides[1] == 1 and scales.strides[1] == 1
          and codes.shape[1] % BLOCK == 0 and scales.shape == (codes.shape[0], codes.shape[1] // BLOCK))
    info = (_ptr(codes), codes.strides[0], _ptr(scales), scales.strides[0], *codes.shape) if ok else None
    try:
        if len(_TABLE_INFO) > 64:
            _TABLE_INFO.clear()
        _TABLE_INFO[key] = (weakref.ref(codes), weakref.ref(scales), info)
    except TypeError:  # not weak-referenceable: just don't remember it
        pass
    return info


def gather_decode(codes: np.ndarray, scales: np.ndarray, addresses: np.ndarray,
                  dtype: torch.dtype = torch.float32, out: torch.Tensor | None = None) -> torch.Tensor:
    """Gather MXFP8 rows by address and decode them in one pass.

    codes: u8 [rows, D] (typically a read-only mmap), scales: u8 [rows, D/32],
    addresses: int64 [T, C]. Returns dtype [T, C*D] in column order: position t's row for
    column c occupies [c*D, (c+1)*D), the layout the projection consumes.
    Uses the native kernel for float32/bfloat16 when it is available, else the numpy path;
    both give the same bits. An address outside the table raises EngramflowError.
    """
    lib = native.library()
    info = _table_info(codes, scales) if lib is not None and dtype in _NATIVE_GATHER else None
    if info is None or getattr(addresses, "ndim", 0) != 2:
        return gather_decode_numpy(codes, scales, addresses, dtype, out)
    t, c = addresses.shape
    rows, d = info[4], info[5]
    if out is None:
        out = torch.empty(t, c * d, dtype=dtype)
    elif out.dtype != dtype or out.numel() != t * c * d or out.device.type != "cpu" or not out.is_contiguous():
        raise EngramflowError(f"out must be a contiguous CPU {dtype} tensor of {t * c * d} values, "
                              f"got {out.dtype} {list(out.shape)} on {out.device}")
    # a bytes copy of the (tiny) address array is the cheapest way to hand ctypes a pointer
    flat = np.asarray(addresses, dtype=np.int64).tobytes()
    fn = lib.ef_gather_decode_f32 if dtype == torch.float32 else lib.ef_gather_decode_bf16
    bad = fn(info[0], info[1], info[2], info[3], rows, flat, t * c, d, out.data_ptr())
    if bad >= 0:
        raise EngramflowError(f"address {int(np.asarray(addresses).reshape(-1)[bad])} is outside the table of {rows} rows")
    return out


_NATIVE_GATHER = (torch.float32, torch.bfloat16)


def gather_decode_numpy(codes: np.ndarray, scales: np.ndarray, addresses: np.ndarray,
                        dtype: torch.dtype = torch.float32, out: torch.Tensor | None = None) -> torch.Tensor:
    """gather_decode without the native kernel: joint (scale << 8 | code) table lookup."""
    addresses = np.asarray(addresses)
    t, c = addresses.shape
    rows, d = codes.shape
    flat = addresses.reshape(-1)
    if flat.size and (flat.min() < 0 or flat.max() >= rows):  # numpy would wrap negative ones
        bad = flat[(flat < 0) | (flat >= rows)][0]
        raise EngramflowError(f"address {int(bad)} is outside the table of {rows} rows")
    idx = (scales[flat].astype(np.int32) << 8)[:, :, None] | codes[flat].reshape(t * c, d // BLOCK, BLOCK)
    table = joint_table(dtype)
    if out is None:
        out = torch.empty(t, c * d, dtype=dtype)
    torch.index_select(table, 0, torch.from_numpy(idx.reshape(-1)), out=out.view(-1))
    return out

