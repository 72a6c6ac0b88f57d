"""MXFP8 Engram table rows: E4M3 codes with one E8M0 scale per 32 values (the formats
themselves: kernels/formats.py), decoded or gathered and decoded by address.

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
from engramflow.kernels.formats import BLOCK, E4M3_F64, e8m0_to_float

_NAN_BITS = {torch.float32: 0x7FC00000, torch.bfloat16: 0x7FC0, torch.float16: 0x7E00}
_BITS_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def _canonical_nan(t: torch.Tensor) -> torch.Tensor:
    """Replace every NaN by the dtype's positive quiet NaN (torch's f64->bf16 cast makes 0xFFFF)."""
    nan = torch.tensor(_NAN_BITS[t.dtype], dtype=torch.int32).to(_BITS_VIEW[t.dtype]).view(t.dtype)
    return torch.where(torch.isnan(t), nan, t)


def _joint_table(dtype: torch.dtype) -> torch.Tensor:
    """[256 scales * 256 codes] -> e4m3(code) * 2^(scale-127), rounded once into `dtype`."""
    scales = e8m0_to_float(torch.arange(256, dtype=torch.uint8)).double().numpy()
    joint = scales[:, None] * E4M3_F64[None, :]
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

