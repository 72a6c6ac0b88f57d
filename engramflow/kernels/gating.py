"""Engram gating: fold the projected value into the hc residual streams (docs/v41.md, "Engram").

Per position t and stream s, in fp32:
    rstd = rsqrt(mean(h_s²) + eps) * rsqrt(mean(key_s²) + eps)
    dot  = sum(h_s * w_s * key_s) * rstd * dim^-0.5           (w = q_weight * k_weight)
    gate = sigmoid(copysign(sqrt(max(|dot|, 1e-6)), dot))
    h_s += gate * value
in the official code's operation order (a multiply by dim^-0.5, a separate product and sum, not a
fused multiply-add), so a V4.1 stage gets its bits.
Masked (image) positions get gate 0: their rows come back bit-identical.
Plain torch ops, so it runs wherever h lives (CPU or GPU).
"""
from __future__ import annotations


import torch

from engramflow.errors import EngramflowError
from engramflow.kernels import rowwise


class EngramGate:
    def __init__(self, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float = 1e-6):
        if q_weight.ndim != 2 or q_weight.shape != k_weight.shape:
            raise EngramflowError(f"gate weights must both be [hc, dim], got q {list(q_weight.shape)} "
                                  f"and k {list(k_weight.shape)}")
        self.hc, self.dim = q_weight.shape
        self.eps = float(eps)
        # pre-multiplied once: the product is what the dot product needs
        self.w = (q_weight.detach().float() * k_weight.detach().to(q_weight.device).float()).contiguous()

    def to(self, device) -> "EngramGate":
        gate = object.__new__(EngramGate)
        gate.hc, gate.dim, gate.eps = self.hc, self.dim, self.eps
        gate.w = self.w.to(device)
        return gate

    def _check(self, h: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask) -> None:
        t = h.shape[0] if h.ndim == 3 else None
        if h.ndim != 3 or tuple(h.shape[1:]) != (self.hc, self.dim):
            raise EngramflowError(f"h must be [T, {self.hc}, {self.dim}], got {list(h.shape)}")
        if not h.is_floating_point():
            raise EngramflowError(f"h must be a float tensor, got {h.dtype}")
        if tuple(key.shape) != (t, self.hc, self.dim):
            raise EngramflowError(f"key must be [{t}, {self.hc}, {self.dim}] like h, got {list(key.shape)}")
        if tuple(value.shape) != (t, self.dim):
            raise EngramflowError(f"value must be [{t}, {self.dim}], got {list(value.shape)}")
        if mask is not None and (mask.dtype != torch.bool or tuple(mask.shape) != (t,)):
            raise EngramflowError(f"mask must be bool [{t}], got {mask.dtype} {list(mask.shape)}")

    def __call__(self, h: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 mask: torch.Tensor | None = None) -> torch.Tensor:
        """New tensor like h (dtype, device): h with the gated value added to each stream."""
        self._check(h, key, value, mask)
        dev = h.device
        if self.w.device != dev:
            self.w = self.w.to(dev)
        hf = h.float()
        kf = key.to(dev, non_blocking=True).float()
        vf = value.to(dev, non_blocking=True).float()
        rstd = torch.rsqrt(hf.square().mean(-1) + self.eps) * torch.rsqrt(kf.square().mean(-1) + self.eps)
        dot = (hf * self.w * kf).sum(-1) * rstd * self.dim ** -0.5  # [T, hc]
        gate = rowwise.sigmoid(torch.copysign(torch.sqrt(dot.abs().clamp_min(1e-6)), dot))
        out = (hf + gate.unsqueeze(-1) * vf.unsqueeze(1)).to(h.dtype)
        if mask is not None:
            # copy masked rows as they were: h + 0*value could still turn -0.0 into +0.0,
            # or NaN in from an inf value
            out = torch.where(mask.to(dev).view(-1, 1, 1), h, out)
        return out
