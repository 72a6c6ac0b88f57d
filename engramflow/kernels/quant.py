"""The quantised arithmetic of DeepSeek V4.1 (docs/v41.md, "Numerics"), as plain torch on any
device; the number formats themselves are decoded in kernels/formats.py.

* Activation quantisation before every FP8/FP4 GEMM: groups of 32 along K, amax floored at
  1e-4, a power-of-two scale 2^ceil(log2(amax / 448)) taken from the fp32 bits of
  amax · fp32(1/448), values rounded to E4M3 (nearest even, saturating at ±448).
* Fake quantisation (QDQ) of cached activations: FP8 as above, or FP4 E2M1 in groups of 16 with
  an E4M3 scale (compressed KV) or groups of 32 with an E8M0 scale (index keys and queries).
* The block-scaled GEMM: per 32-wide K block, an exact-in-practice fp32 partial product of the
  quantised activation and weight values, multiplied by both power-of-two scales and summed
  over K blocks in K order in fp32. Only the order inside one block is free; the K order is
  kept because a one-ulp change anywhere is amplified by the model's re-quantisations.

Weights are held as their exact values (E4M3 or E2M1 codes decoded; both fit bf16) plus one
fp32 scale per (output row, K block), so FP8 32×32 tiles and FP4 per-row groups share one GEMM.
"""
from __future__ import annotations


import torch

from engramflow.errors import EngramflowError
from engramflow.kernels import sum_order
from engramflow.kernels.formats import BLOCK, FP4_MAX, FP8_MAX, e2m1_values, e4m3_to_float32, e8m0_to_float

_INV_FP8 = torch.tensor(1.0 / FP8_MAX, dtype=torch.float32)
_INV_FP4 = torch.tensor(1.0 / FP4_MAX, dtype=torch.float32)


def pow2_ceil_scale(amax: torch.Tensor, inv_max: torch.Tensor) -> torch.Tensor:
    """2^ceil(log2(amax·inv_max)), from the fp32 bits of the product: its exponent, plus one when
    the mantissa is not zero. Exact, so it matches the GPU kernels' bit trick."""
    prod = (amax.float() * inv_max.to(amax.device)).contiguous()
    bits = prod.view(torch.int32)
    exponent = (bits >> 23) & 0xFF
    exponent = exponent + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return (exponent << 23).view(torch.float32)


def _groups(x: torch.Tensor, group: int) -> torch.Tensor:
    if x.shape[-1] % group:
        raise EngramflowError(f"quantised width {x.shape[-1]} is not a multiple of the group size {group}")
    return x.float().unflatten(-1, (-1, group))


def fp8_act_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (E4M3 values as fp32 [..., K], fp32 power-of-two scales [..., K/32])."""
    g = _groups(x, BLOCK)
    scale = pow2_ceil_scale(g.abs().amax(-1).clamp_min(1e-4), _INV_FP8)
    q = (g / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()
    return q.flatten(-2), scale


def fp8_qdq(x: torch.Tensor) -> torch.Tensor:
    """FP8 fake quantisation per 32 values, back in x's dtype (the window KV cache)."""
    q, scale = fp8_act_quant(x)
    return (q.unflatten(-1, (-1, BLOCK)) * scale.unsqueeze(-1)).flatten(-2).to(x.dtype)


def e2m1_round(v: torch.Tensor) -> torch.Tensor:
    """fp32 in [-6, 6] -> nearest E2M1 value (ties to the even code), sign of zero kept.
    The grid spacing is 0.5 below 2, 1 below 4 and 2 up to 6; torch.round ties to even, and
    at every tie the even multiple of the spacing is the even code."""
    mag = v.abs()
    step = torch.where(mag < 2, 0.5, torch.where(mag < 4, 1.0, 2.0))
    return torch.copysign(torch.round(mag / step) * step, v)


def fp4_qdq(x: torch.Tensor, group: int, e4m3_scale: bool) -> torch.Tensor:
    """FP4 E2M1 fake quantisation, back in x's dtype.

    e4m3_scale=True (compressed KV, groups of 16): scale = e4m3(amax / 6), amax >= 6·2^-9.
    e4m3_scale=False (index keys/queries, groups of 32): scale = 2^ceil(log2(amax/6)), amax >= 6·2^-126.
    """
    g = _groups(x, group)
    amax = g.abs().amax(-1)
    if e4m3_scale:
        scale = (amax.clamp_min(6 * 2.0 ** -9) / FP4_MAX).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()
    else:
        scale = pow2_ceil_scale(amax.clamp_min(6 * 2.0 ** -126), _INV_FP4)
    v = (g / scale.unsqueeze(-1)).clamp(-FP4_MAX, FP4_MAX)
    return (e2m1_round(v) * scale.unsqueeze(-1)).flatten(-2).to(x.dtype)


class QuantWeight:
    """A weight for the block-scaled GEMM: exact values (E4M3 / E2M1 decoded, held in fp32 as
    [K/32, 32, N], the layout the per-block products read) and fp32 scales, one per output row
    and K block (an FP8 32×32 tile scale is repeated over its 32 rows)."""

    def __init__(self, values: torch.Tensor, row_scales: torch.Tensor):
        n, k = values.shape
        if k % BLOCK or tuple(row_scales.shape) != (n, k // BLOCK):
            raise EngramflowError(f"quantised weight [{n}, {k}] needs scales [{n}, {k // BLOCK}], "
                                  f"got {list(row_scales.shape)}")
        self.blocks = values.float().view(n, k // BLOCK, BLOCK).permute(1, 2, 0).contiguous()
        self.scales = row_scales.float().t().unsqueeze(1).contiguous()  # [K/32, 1, N]
        self.out_features, self.in_features = n, k
        self.fmt = None  # "fp8" / "fp4" when built from codes: the native kernel takes those

    @classmethod
    def fp8(cls, codes: torch.Tensor, tile_scale: torch.Tensor) -> "QuantWeight":
        """E4M3 [N, K] with one scale per 32×32 tile [ceil(N/32), K/32] (E8M0 or fp32)."""
        n, k = codes.shape
        want = ((n + BLOCK - 1) // BLOCK, (k + BLOCK - 1) // BLOCK)
        if tuple(tile_scale.shape) != want:
            raise EngramflowError(f"FP8 weight [{n}, {k}] needs 32x32 tile scales {list(want)}, got {list(tile_scale.shape)}")
        s = tile_scale.float() if tile_scale.dtype == torch.float32 else e8m0_to_float(tile_scale)
        w = cls(e4m3_to_float32(codes), s.repeat_interleave(BLOCK, dim=0)[:n])
        w.fmt = "fp8"
        return w

    @classmethod
    def fp4(cls, packed: torch.Tensor, row_scale: torch.Tensor) -> "QuantWeight":
        """Packed E2M1 [N, K/2] with E8M0 scales [N, K/32]."""
        w = cls(e2m1_values(packed), e8m0_to_float(row_scale))
        w.fmt = "fp4"
        return w

    @property
    def values(self) -> torch.Tensor:
        """The exact weight values [N, K] (without scales)."""
        return self.blocks.permute(2, 0, 1).reshape(self.out_features, self.in_features)

    def dequantized(self) -> torch.Tensor:
        """fp32 [N, K] = values · scale (exact); for the dense baseline and for `wo_a`."""
        return (self.blocks * self.scales).permute(2, 0, 1).reshape(self.out_features, self.in_features)

    def to(self, device) -> "QuantWeight":
        w = object.__new__(QuantWeight)
        w.blocks, w.scales = self.blocks.to(device), self.scales.to(device)
        w.out_features, w.in_features, w.fmt = self.out_features, self.in_features, self.fmt
        return w


def quant_linear(x: torch.Tensor, w: QuantWeight, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """y = x @ Wᵀ the way the V4.1 kernels compute it (see quant_linear_reference): on the CPU by
    the native kernel (kernels/block_scaled.py), the same bits; elsewhere, or without the
    library, by the torch reference."""
    if x.shape[-1] != w.in_features:
        raise EngramflowError(f"quantised linear expects input width {w.in_features}, got {x.shape[-1]}")
    if x.device.type == "cpu":
        from engramflow.kernels import block_scaled  # imports this module
        y = block_scaled.linear(x, w, out_dtype)
        if y is not None:
            return y
    return quant_linear_reference(x, w, out_dtype)


def quant_linear_reference(x: torch.Tensor, w: QuantWeight, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """y = x @ Wᵀ the way the V4.1 kernels compute it: x quantised to FP8 per 32 values, then
    the block-scaled GEMM summed over K blocks in K order (fp32), cast to out_dtype.

    Each block's 32 products (exact) are summed by torch.bmm (MKL), whose order decides the
    bits where a sum rounds: j = 0..31 in order for two or more rows; for one row (a GEMV, the
    order the golden decode data carries) a fixed tree on x86-64 AVX-512 CPUs, except for the
    last N mod 16 columns, summed in order. kernels/block_scaled.c reproduces both. With
    batched numerics one row is computed as two (itself twice): j in order for every row."""
    if x.shape[-1] != w.in_features:
        raise EngramflowError(f"quantised linear expects input width {w.in_features}, got {x.shape[-1]}")
    lead = x.shape[:-1]
    q, sa = fp8_act_quant(x.reshape(-1, w.in_features))
    m_out = q.shape[0]
    if m_out == 1 and sum_order.batch_invariant():
        q, sa = q.expand(2, -1), sa.expand(2, -1)
    m, nb = q.shape[0], w.in_features // BLOCK
    out = torch.empty(m, w.out_features, dtype=torch.float32, device=x.device)
    qa = q.reshape(m, nb, BLOCK).transpose(0, 1)  # [nb, M, 32]
    sa_t = sa.t().unsqueeze(-1)  # [nb, M, 1]
    chunk = max(BLOCK, sum_order.PARTIAL_BUDGET // max(1, nb * m))
    for n0 in range(0, w.out_features, chunk):
        n1 = min(n0 + chunk, w.out_features)
        partial = torch.bmm(qa, w.blocks[:, :, n0:n1])  # [nb, M, n]: each block's products, exact
        partial = partial * sa_t * w.scales[:, :, n0:n1]
        acc = torch.zeros_like(partial[0])
        for k in range(nb):  # K order, fp32, as the kernels accumulate
            acc += partial[k]
        out[:, n0:n1] = acc
    return out[:m_out].to(out_dtype).view(*lead, w.out_features)
