"""Small numeric helpers every V4.1 layer uses: RMSNorm in fp32 and the dense linears.

The official code runs under a bf16 default dtype; these keep its roundings: RMSNorm computes in
fp32 and rounds once into the input's dtype; a dense linear runs in its weight's dtype.
"""
from __future__ import annotations

import torch
from engramflow.kernels import dense_rows, sum_order
from engramflow.kernels.quant import QuantWeight, quant_linear


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    return (weight * xf).to(x.dtype)


def linear(x: torch.Tensor, weight: torch.Tensor | QuantWeight) -> torch.Tensor:
    """A quantised weight takes the FP8 activation path (bf16 out); a dense one F.linear in its
    own dtype (bf16 or fp32 weights, as the checkpoint's roles require)."""
    if isinstance(weight, QuantWeight):
        return quant_linear(x, weight, torch.bfloat16)
    return dense_linear(x.to(weight.dtype), weight)


def dense_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.linear in the weight's dtype; in batched numerics each row's bits its own
    (kernels/dense_rows.py): torch's GEMM over T rows may sum in another order than the one-row
    GEMV a decode step runs."""
    return dense_rows.linear(x, weight)


def grouped_projection(o: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """o [T, g, d] x w [g, r, d] -> [T, g, r]: each group's own projection (official: a batched
    matmul over the groups, as the official code; batched numerics: one row-invariant linear
    per group)."""
    if sum_order.batch_invariant() and o.device.type == "cpu":
        return torch.stack([dense_rows.linear(o[:, g], w[g]) for g in range(w.shape[0])], dim=1)
    return torch.einsum("bsgd,grd->bsgr", o.unsqueeze(0), w)[0]
