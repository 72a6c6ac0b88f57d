"""Hyper-connections: the residual stream as hc parallel copies (docs/v41.md, "Hyper-connections").

Each sublayer (attention, MoE) has fn [mix, hc·D], base [mix] and scale [3] (fp32), with
mix = (2 + hc)·hc. From the stream x [T, hc, D] it derives, per token:
  pre  [hc]     : how the copies collapse into the next sublayer's input (used one step later)
  post [hc]     : how the sublayer output spreads back over the copies
  comb [hc, hc] : a Sinkhorn-normalised mix of the residual copies (row = source copy)
"""
from __future__ import annotations

import torch

from engramflow.kernels import rowwise
from engramflow.model.v41.ops import dense_linear


class HyperMix:
    def __init__(self, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc: int,
                 sinkhorn_iters: int, hc_eps: float, norm_eps: float):
        self.fn, self.base, self.scale = fn.float(), base.float(), scale.float()
        self.hc, self.iters, self.hc_eps, self.norm_eps = hc, sinkhorn_iters, hc_eps, norm_eps

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, hc, D] bf16 -> pre [T, hc], post [T, hc], comb [T, hc, hc], all fp32."""
        flat = x.flatten(-2).float()
        rstd = torch.rsqrt(flat.square().mean(-1, keepdim=True) + self.norm_eps)  # one statistic per token
        m = dense_linear(flat, self.fn) * rstd
        hc, s, b, eps = self.hc, self.scale, self.base, self.hc_eps
        pre = rowwise.sigmoid(m[..., :hc] * s[0] + b[:hc]) + eps
        post = 2 * rowwise.sigmoid(m[..., hc:2 * hc] * s[1] + b[hc:2 * hc])
        comb = (m[..., 2 * hc:] * s[2] + b[2 * hc:]).unflatten(-1, (hc, hc))
        comb = rowwise.exp(comb - comb.amax(dim=-1, keepdim=True))  # row softmax, then + eps
        comb = comb / comb.sum(dim=-1, keepdim=True) + eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
        for _ in range(self.iters - 1):  # alternate rows and columns; a column step ends it
            comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
        return pre, post, comb


def collapse(x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """Σ_c pre[c]·x[c] in fp32, back to x's dtype. x [T, hc, D], pre [T, hc] -> [T, D]."""
    return torch.sum(pre.unsqueeze(-1) * x.float(), dim=-2).to(x.dtype)


def expand(f: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """Copy b = post[b]·f + Σ_a comb[a, b]·residual[a], in fp32, back to f's dtype."""
    y = post.unsqueeze(-1) * f.unsqueeze(-2) + torch.sum(comb.unsqueeze(-1) * residual.unsqueeze(-2), dim=-3)
    return y.type_as(f)


def identity_pre(n: int, hc: int, device=None) -> torch.Tensor:
    """The collapse weights entering layer 0: copy 0 alone."""
    pre = torch.zeros(n, hc, dtype=torch.float32, device=device)
    pre[:, 0] = 1.0
    return pre
