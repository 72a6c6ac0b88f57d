"""The native block-scaled quantised linear (block_scaled.c): `quant_linear`'s arithmetic, bit for
bit, at the machine's read bandwidth (few rows) or its fp32 FMA rate (many rows).

A QuantWeight is packed once, on first use, into the kernel's layout (cached on the weight):
32 output columns per group, the group's codes k-major (FP8: one E4M3 byte per value; FP4:
one byte per value pair, two E2M1 codes) and one E8M0 byte per (column, 32-wide K block).
`linear` returns None when the kernel cannot take the call (no library, a tensor off the
CPU, a weight whose values or scales the byte formats cannot hold); quant_linear then runs its
torch reference, which gives the same bits.
"""
from __future__ import annotations

import functools

import torch

from engramflow.kernels import block_scaled_lib, sum_order

GROUP = 32  # output columns per weight group (GROUP in block_scaled.c)
FMT_FP8, FMT_FP4 = 0, 1
# below this many weights a call runs on one thread (starting threads costs more)
MIN_WEIGHTS_PER_THREAD = 1 << 18


class PackedWeight:
    """A QuantWeight in the kernel's byte layout."""

    def __init__(self, fmt: int, codes: torch.Tensor, scales: torch.Tensor, out_features: int, in_features: int):
        self.fmt, self.codes, self.scales = fmt, codes, scales
        self.out_features, self.in_features = out_features, in_features


def _group_major(rows: torch.Tensor, pad_value: int) -> torch.Tensor:
    """[N, C] bytes -> [ceil(N/32), C, 32]: each group's 32 columns side by side per position."""
    n, c = rows.shape
    groups = -(-n // GROUP)
    padded = torch.full((groups * GROUP, c), pad_value, dtype=torch.uint8)
    padded[:n] = rows
    return padded.view(groups, GROUP, c).transpose(1, 2).contiguous()


def _e8m0_bytes(scales: torch.Tensor) -> torch.Tensor | None:
    """fp32 scales [N, nb] -> E8M0 bytes, or None unless every scale is 2^e with e in [-126, 127]."""
    bits = scales.float().contiguous().view(torch.int32)
    exponent = (bits >> 23) & 0xFF
    if bool(((bits & 0x807FFFFF) != 0).any()) or bool(((exponent == 0) | (exponent == 255)).any()):
        return None
    return exponent.to(torch.uint8)


def _e2m1_codes(values: torch.Tensor) -> torch.Tensor | None:
    """Exact E2M1 values [N, K] -> codes (sign in bit 3), or None if a value is not on the grid."""
    mag2 = (values.abs() * 2).to(torch.int64)  # 0, 1, 2, 3, 4, 6, 8, 12 for the 8 magnitudes
    code_of = torch.full((13,), -1, dtype=torch.int64)
    code_of[torch.tensor([0, 1, 2, 3, 4, 6, 8, 12])] = torch.arange(8)
    if bool((values.abs() > 6).any()) or bool(((mag2.float() / 2) != values.abs()).any()):
        return None
    codes = code_of[mag2.clamp(0, 12)]
    if bool((codes < 0).any()):
        return None
    return (codes | (torch.signbit(values).to(torch.int64) << 3)).to(torch.uint8)


def pack(w) -> PackedWeight | None:
    """The kernel's layout of QuantWeight w, or None when its values or scales do not fit it."""
    fmt = getattr(w, "fmt", None)
    if fmt not in ("fp8", "fp4") or w.blocks.device.type != "cpu":
        return None
    n, k = w.out_features, w.in_features
    scales = _e8m0_bytes(w.scales.view(k // GROUP, n).t())
    if scales is None:
        return None
    values = w.values
    if fmt == "fp8":
        codes = values.to(torch.float8_e4m3fn).view(torch.uint8)
        if bool(((codes & 0x7F) == 0x7F).any()):  # NaN codes: left to the reference
            return None
        kind = FMT_FP8
    else:
        nibbles = _e2m1_codes(values)
        if nibbles is None:
            return None
        codes = nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)  # the even k in the low nibble
        kind = FMT_FP4
    return PackedWeight(kind, _group_major(codes, 0), _group_major(scales, 127), n, k)


def packed(w) -> PackedWeight | None:
    """pack(w), made once per weight and kept on it."""
    cached = getattr(w, "_native_pack", False)
    if cached is False:
        cached = pack(w)
        w._native_pack = cached
    return cached


def _tree_sum(p: torch.Tensor) -> torch.Tensor:
    """gemv_tree_sum of block_scaled.c over p [32, n] (fp32, column-wise)."""
    s = ((p[0] + p[2]) + (p[1] + p[3])) + ((p[4] + p[6]) + (p[5] + p[7]))
    for c in range(8, 32, 8):
        s = s + p[c + 6]
        s = s + p[c + 4]
        s = s + (p[c + 5] + p[c + 7])
        s = s + ((p[c] + p[c + 2]) + (p[c + 1] + p[c + 3]))
    return s


def _in_order_sum(p: torch.Tensor) -> torch.Tensor:
    s = p[0]
    for j in range(1, 32):
        s = s + p[j]
    return s


@functools.cache  # threads may probe at once (a projection actor runs its layers in threads): same result
def torch_block_orders() -> tuple[bool, str | None]:
    """How this machine's torch.bmm sums a block of 32 products (it is MKL's choice, by CPU):
    (two or more rows in order?, one row: 'tree' (gemv_tree_sum for the first N - N mod 16
    columns, in order for the rest), 'in-order', or None: another order the kernel lacks).
    Probed once on products that round."""
    g = torch.Generator().manual_seed(1)
    p = torch.randn(32, 40, generator=g) * torch.exp(4 * torch.randn(32, 40, generator=g))
    ones = torch.ones(1, 1, 32)
    one_row = torch.bmm(ones, p.unsqueeze(0))[0, 0]
    two_rows = torch.bmm(torch.ones(1, 2, 32), p.unsqueeze(0))[0, 1]
    tree = torch.cat([_tree_sum(p[:, :32]), _in_order_sum(p[:, 32:])])
    many = torch.equal(two_rows, _in_order_sum(p))
    one = "tree" if torch.equal(one_row, tree) else "in-order" if torch.equal(one_row, _in_order_sum(p)) else None
    return many, one


def threads_for(n: int, k: int) -> int:
    return max(1, min(torch.get_num_threads(), n * k // MIN_WEIGHTS_PER_THREAD))


def linear(x: torch.Tensor, w, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor | None:
    """quant_linear(x, w, out_dtype) on the native kernel; None when it cannot run it."""
    if x.device.type != "cpu":
        return None
    lib = block_scaled_lib.library()
    if lib is None:
        return None
    p = packed(w)
    if p is None:
        return None
    lead = x.shape[:-1]
    rows = x.reshape(-1, p.in_features)
    in_order, one_row = torch_block_orders()
    if not in_order:
        return None  # a torch whose block sums the kernel does not reproduce: the reference runs
    gemv = rows.shape[0] == 1 and not sum_order.batch_invariant() and one_row != "in-order"
    if gemv and (one_row is None or p.out_features > sum_order.gemv_columns(p.in_features // GROUP)):
        return None  # a one-row order (or the reference's split of a wide one) not modelled here
    if rows.dtype not in (torch.float32, torch.bfloat16):
        rows = rows.float()  # quant_linear quantises x.float(): exact for every narrower dtype
    rows = rows.contiguous()
    direct = out_dtype in (torch.float32, torch.bfloat16)
    out = torch.empty(rows.shape[0], p.out_features, dtype=out_dtype if direct else torch.float32)
    rc = lib.ebs_linear(p.fmt, rows.data_ptr(), int(rows.dtype == torch.bfloat16), rows.shape[0], p.in_features,
                        p.codes.data_ptr(), p.scales.data_ptr(), p.out_features, out.data_ptr(),
                        int(out.dtype == torch.bfloat16), int(gemv), threads_for(p.out_features, p.in_features))
    if rc != 0:
        raise MemoryError(f"block-scaled GEMM [{rows.shape[0]}, {p.in_features}] x [{p.out_features}] failed "
                          f"(code {rc})")
    if not direct:
        out = out.to(out_dtype)
    return out.view(*lead, p.out_features)


def act_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's FP8 activation quantisation of x [T, K] (fp32 or bf16): (q as fp32, scales),
    for comparing it with fp8_act_quant."""
    lib = block_scaled_lib.library()
    t, k = x.shape
    x = x.contiguous()
    qs = torch.empty(t, k)
    sa = torch.empty(t, k // GROUP)
    lib.ebs_act_quant(x.data_ptr(), int(x.dtype == torch.bfloat16), t, k, qs.data_ptr(), sa.data_ptr())
    return qs / 256, sa
