"""Rotary embedding of V4.1: partial (the last rope_head_dim dims), pairs (2i, 2i+1) as complex
numbers, YaRN frequencies on compressed layers, no mscale (docs/v41.md, "Attention").

Frequencies and angles are fp32 (angle = fp32(position) · fp32 frequency), the rotation is a
complex64 product, and the result is rounded back into the input's dtype, as the official code
does in place.
"""
from __future__ import annotations

import math

import torch

from engramflow.kernels import rowwise


def inverse_frequencies(dim: int, theta: float, original_seq_len: int = 0, factor: float = 1.0,
                        beta_fast: int = 32, beta_slow: int = 1) -> torch.Tensor:
    """fp32 [dim/2]. With original_seq_len > 0, YaRN: a linear ramp between the dims whose
    wavelength turns beta_fast and beta_slow times over the training context blends each
    frequency from f (short wavelengths) to f/factor (long ones)."""
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if original_seq_len > 0:
        def dim_for(turns: float) -> float:
            return dim * math.log(original_seq_len / (turns * 2 * math.pi)) / (2 * math.log(theta))
        low = max(math.floor(dim_for(beta_fast)), 0)
        high = min(math.ceil(dim_for(beta_slow)), dim - 1)
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / max(high - low, 1e-3)).clamp(0, 1)
        keep = 1 - ramp
        freqs = freqs / factor * (1 - keep) + freqs * keep
    return freqs


class Rotary:
    """Rotations for one layer kind; `rotate(x, positions)` works on x's last `dim` values."""

    def __init__(self, dim: int, inv_freq: torch.Tensor):
        self.dim = dim
        self.inv_freq = inv_freq

    def angles(self, positions: torch.Tensor) -> torch.Tensor:
        """complex64 [len(positions), dim/2]."""
        ang = positions.to(torch.float32).unsqueeze(-1) * self.inv_freq.to(positions.device)
        return rowwise.polar_unit(ang)

    def rotate(self, x: torch.Tensor, positions: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        """x [T, ..., D] with T matching positions; returns a new tensor in x's dtype with the
        tail rotated (conjugate rotation when inverse: the attention output at the query)."""
        rot = self.angles(positions)
        if inverse:
            rot = rot.conj()
        rot = rot.view(rot.shape[0], *([1] * (x.dim() - 2)), rot.shape[1])
        tail = torch.view_as_complex(x[..., -self.dim:].float().unflatten(-1, (-1, 2)).contiguous())
        out = x.clone()
        out[..., -self.dim:] = torch.view_as_real(tail * rot).flatten(-2).to(x.dtype)
        return out
