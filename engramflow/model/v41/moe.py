"""V4.1 mixture of experts (docs/v41.md, "MoE").

Gate: scores = sqrtsoftplus(x·Wᵀ / temp) in fp32; the top-k of scores + bias picks experts, the
unbiased scores weight them (normalised by their sum + 1e-20, times route_scale). Each routed
expert (FP4) and the shared expert (FP8) is a clamped SwiGLU; a routed expert's weight multiplies
its activation before w2, so it enters w2's FP8 activation quantisation. Outputs are summed in
fp32 in ascending expert order, then the shared expert's, and rounded to bf16.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engramflow.kernels import rowwise
from engramflow.model.v41.config import V41Config
from engramflow.model.v41.ops import dense_linear, linear


@dataclass
class ExpertWeights:
    w1: object  # QuantWeight [inter, dim]
    w2: object  # QuantWeight [dim, inter]
    w3: object  # QuantWeight [inter, dim]


@dataclass
class MoEWeights:
    gate: torch.Tensor       # [experts, dim] (bf16 in the checkpoint, used in fp32)
    bias: torch.Tensor       # [experts] fp32
    experts: list[ExpertWeights]
    shared: ExpertWeights
    bias_vl: torch.Tensor | None = None  # [experts] fp32: the selection bias of image-span tokens


def expert_forward(x: torch.Tensor, w: ExpertWeights, limit: float, weights: torch.Tensor | None = None) -> torch.Tensor:
    gate = linear(x, w.w1).float()
    up = linear(x, w.w3).float()
    if limit > 0:
        up = up.clamp(-limit, limit)
        gate = gate.clamp(max=limit)
    a = rowwise.silu(gate) * up
    if weights is not None:
        a = weights * a
    return linear(a.to(x.dtype), w.w2)


class MoE:
    def __init__(self, cfg: V41Config, w: MoEWeights):
        self.cfg, self.w = cfg, w

    def route(self, x: torch.Tensor, image_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        scores = dense_linear(x.float(), self.w.gate) / cfg.gate_temp
        if cfg.score_func == "softmax":
            scores = rowwise.softmax(scores, dim=-1)
        elif cfg.score_func == "sigmoid":
            scores = rowwise.sigmoid(scores)
        else:
            scores = rowwise.softplus(scores).sqrt()
        bias = self.w.bias
        if image_mask is not None and self.w.bias_vl is not None:
            bias = torch.where(image_mask.unsqueeze(-1), self.w.bias_vl, bias)
        chosen = (scores + bias).topk(cfg.n_activated_experts, dim=-1)[1]
        weights = scores.gather(1, chosen)
        if cfg.norm_topk_prob and cfg.n_activated_experts > 1:
            weights /= weights.sum(dim=-1, keepdim=True) + 1e-20  # the official constant, not norm_eps
        weights *= cfg.route_scale
        return weights, chosen

    def __call__(self, x: torch.Tensor, image_mask: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, dim] bf16 -> [T, dim] bf16; image_mask bool [T] selects bias_vl."""
        weights, chosen = self.route(x, image_mask)
        y = torch.zeros_like(x, dtype=torch.float32)
        counts = torch.bincount(chosen.flatten(), minlength=len(self.w.experts)).tolist()
        for e, expert in enumerate(self.w.experts):
            if counts[e]:
                rows, slot = torch.where(chosen == e)
                y[rows] += expert_forward(x[rows], expert, self.cfg.swiglu_limit, weights[rows, slot, None])
        y += expert_forward(x, self.w.shared, self.cfg.swiglu_limit)
        return y.type_as(x)
