"""Small numeric helpers every V4.1 layer uses: RMSNorm in fp32 and the dense linears.

The official code runs under a bf16 default dtype; these keep its roundings: RMSNorm computes in
fp32 and rounds once into the input's dtype; a dense linear runs in its weight's dtype.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engramflow.kernels import sum_order
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
    """F.linear; with ENGRAMFLOW_BATCH_INVARIANT=1 one row at a time. A GEMM over T rows may sum
    in another order than the one-row GEMV a decode step runs, so a row's bits could depend on
    how many rows share the call; row by row, every row gets the decode step's bits."""
    rows = x.reshape(-1, x.shape[-1])
    if not sum_order.BATCH_INVARIANT or rows.shape[0] == 1:
        return F.linear(x, weight)
    return torch.cat([F.linear(r, weight) for r in rows.split(1)]).view(*x.shape[:-1], weight.shape[0])


def grouped_projection(o: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """o [T, g, d] x w [g, r, d] -> [T, g, r]: each group's own projection (a batched matmul over
    the groups; with ENGRAMFLOW_BATCH_INVARIANT=1 one row at a time, as `dense_linear`)."""
    def project(rows: torch.Tensor) -> torch.Tensor:
        return torch.einsum("bsgd,grd->bsgr", rows.unsqueeze(0), w)[0]

    if not sum_order.BATCH_INVARIANT or o.shape[0] == 1:
        return project(o)
    return torch.cat([project(r) for r in o.split(1)])
