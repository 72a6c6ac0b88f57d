"""Elementwise transcendental functions (exp, sigmoid, SiLU, softplus, cos/sin) whose result for
an element does not depend on the size of the tensor it comes in, for the batched numerics.

torch computes such a function with vector code (SLEEF and its own polynomials) over the body of
a tensor and with scalar code over the last few elements (and at each thread's chunk end); the
two agree to an ulp, not to the bit. So an element's bits would depend on how many elements its
tensor holds: on which sessions share a step. Here the flattened input is padded to a multiple
of one vector iteration (PAD elements, zeros) and split into single-thread chunks of a multiple
of it (below torch's parallel grain), so every element takes the vector path. In official
numerics the functions are torch's, unchanged.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engramflow.kernels import sum_order

PAD = 64  # two 512-bit vectors of fp32 (one of bf16): a whole unrolled vector iteration
CHUNK = 16_384  # elements per call: a multiple of PAD, under torch's parallel grain (32,768)


def _vector_path(fn, x: torch.Tensor) -> torch.Tensor:
    if not sum_order.batch_invariant() or x.device.type != "cpu" or x.numel() == 0:
        return fn(x)
    flat = x.reshape(-1)
    n = flat.numel()
    flat = F.pad(flat, (0, -n % PAD))
    out = torch.cat([fn(part) for part in flat.split(CHUNK)]) if flat.numel() > CHUNK else fn(flat)
    return out[:n].view(x.shape)


def exp(x: torch.Tensor) -> torch.Tensor:
    return _vector_path(torch.exp, x)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    return _vector_path(torch.sigmoid, x)


def silu(x: torch.Tensor) -> torch.Tensor:
    return _vector_path(F.silu, x)


def softplus(x: torch.Tensor) -> torch.Tensor:
    return _vector_path(F.softplus, x)


def softmax(x: torch.Tensor, dim: int) -> torch.Tensor:
    """exp(x − max) / Σ, per slice along dim; batched numerics take exp's vector path."""
    if not sum_order.batch_invariant():
        return x.softmax(dim=dim)
    e = exp(x - x.amax(dim=dim, keepdim=True))
    return e / e.sum(dim=dim, keepdim=True)


def cos(x: torch.Tensor) -> torch.Tensor:
    return _vector_path(torch.cos, x)


def sin(x: torch.Tensor) -> torch.Tensor:
    return _vector_path(torch.sin, x)


def polar_unit(angle: torch.Tensor) -> torch.Tensor:
    """cos(angle) + i·sin(angle), complex64."""
    return _vector_path(lambda a: torch.polar(torch.ones_like(a), a), angle)
