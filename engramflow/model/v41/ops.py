"""Small numeric helpers every V4.1 layer uses: RMSNorm in fp32 and the dense linears.

The official code runs under a bf16 default dtype; these keep its roundings: RMSNorm computes in
fp32 and rounds once into the input's dtype; a dense linear runs in its weight's dtype.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

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
    return F.linear(x.to(weight.dtype), weight)
