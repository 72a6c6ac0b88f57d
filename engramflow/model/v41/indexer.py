"""The indexer: which compressed rows each query attends to (docs/v41.md, "Attention").

Keys (only layers that compress their own KV and index): fp4QDQ32(RoPE(k_norm(wk(latent))))
at the group's first position. Queries: fp4QDQ32(RoPE(wq_b(qr))) at the token's position.
Score(t, s) = Σ_h ReLU(q[t,h]·k[s]) · w[t,h], w = weights_proj(x)·(d^-½·H^-½), all bf16; rows a
query cannot see yet are −inf. The candidate source also keeps, per query, the best
`candidate_topk_blocks` blocks of `candidate_block_size` rows (its newest block always), and
index sources after it score only inside those. Top-k = the min(index_topk, visible rows of the
last query) best rows, re-sorted ascending, unreachable ones −1.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engramflow.kernels.quant import fp4_qdq
from engramflow.model.v41.config import LayerRole, V41Config
from engramflow.model.v41.ops import linear, rms_norm
from engramflow.model.v41.rope import Rotary


@dataclass
class IndexerWeights:
    wq_b: object                  # QuantWeight [index_heads·index_head_dim, q_lora_rank]
    weights_proj: torch.Tensor    # [index_heads, dim] bf16
    wk: torch.Tensor | None       # [index_head_dim, head_dim] bf16 (key owners)
    k_norm: torch.Tensor | None   # [index_head_dim] bf16


def select_candidate_blocks(scores: torch.Tensor, visible: torch.Tensor, top_blocks: int, block: int) -> torch.Tensor:
    """scores [T, L] (−inf where not visible), visible [T, 1] -> bool [T, L]: rows of the kept blocks."""
    width = scores.shape[-1]
    blocks = F.pad(scores, (0, -width % block), value=-torch.inf).unflatten(-1, (-1, block)).amax(dim=-1)
    n = blocks.shape[-1]
    newest = (visible - 1) // block
    blocks = blocks.masked_fill(torch.arange(n, device=scores.device) == newest, torch.inf)
    top = blocks.topk(min(top_blocks, n), dim=-1)
    keep = torch.zeros_like(blocks, dtype=torch.bool).scatter_(-1, top.indices, top.values > -torch.inf)
    return keep.repeat_interleave(block, dim=-1)[..., :width]


class Indexer:
    def __init__(self, cfg: V41Config, role: LayerRole, w: IndexerWeights, rotary: Rotary):
        self.cfg, self.role, self.w, self.rotary = cfg, role, w, rotary
        self.heads, self.head_dim = cfg.index_n_heads, cfg.index_head_dim
        self.keys = f"index_keys.{role.key_source}"
        self.weight_scale = self.head_dim ** -0.5 * self.heads ** -0.5

    def store_keys(self, g0: int, latent: torch.Tensor, buffers) -> None:
        if latent.shape[0] == 0:
            return
        pos = torch.arange(g0, g0 + latent.shape[0], device=latent.device) * self.role.ratio
        k = rms_norm(linear(latent, self.w.wk), self.w.k_norm, self.cfg.norm_eps)
        k = fp4_qdq(self.rotary.rotate(k, pos), 32, e4m3_scale=False)
        buffers(self.keys)[g0:g0 + k.shape[0]] = k

    def topk(self, x: torch.Tensor, qr: torch.Tensor, positions: torch.Tensor, end: int, buffers,
             step: dict) -> torch.Tensor:
        """int64 [T, k] compressed row indices (−1 = none) for queries at `positions`."""
        r = self.role.ratio
        n_rows = end // r
        q = linear(qr, self.w.wq_b).unflatten(-1, (self.heads, self.head_dim))
        q = fp4_qdq(self.rotary.rotate(q, positions), 32, e4m3_scale=False)
        keys = buffers(self.keys)[:n_rows]
        weights = linear(x, self.w.weights_proj) * self.weight_scale
        score = torch.einsum("bshd,btd->bsht", q.unsqueeze(0), keys.unsqueeze(0))
        score = (score.relu_() * weights.unsqueeze(0).unsqueeze(-1)).sum(dim=2)[0]  # [T, n_rows] bf16
        visible = ((positions + 1) // r).unsqueeze(-1)
        score = score.masked_fill(torch.arange(n_rows, device=x.device) >= visible, -torch.inf)
        if self.role.candidate_source:
            step["candidates"] = select_candidate_blocks(score, visible, self.cfg.candidate_topk_blocks,
                                                         self.cfg.candidate_block_size)
        elif self.role.uses_candidates:
            score = score.masked_fill(~step["candidates"], -torch.inf)
        k = min(self.cfg.index_topk, n_rows)
        idx = score.topk(k, dim=-1, sorted=False).indices.sort(dim=-1).values
        return torch.where(idx < visible, idx, -1)
