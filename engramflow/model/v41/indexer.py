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

from engramflow.kernels import sum_order
from engramflow.kernels.dense_rows import dense_rows
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


def top_indices(scores: torch.Tensor, k: int, sort: bool = False) -> torch.Tensor:
    """The k best columns of each row. Official numerics: torch.topk, as the official code. Batched:
    a stable descending sort, so ties go to the lower index and a row's choice never depends on
    how many columns (a chunk's end) or rows share the call."""
    if sum_order.batch_invariant():
        return scores.sort(dim=-1, descending=True, stable=True).indices[..., :k]
    return scores.topk(k, dim=-1, sorted=sort).indices


def select_candidate_blocks(scores: torch.Tensor, visible: torch.Tensor, top_blocks: int, block: int) -> torch.Tensor:
    """scores [T, L] (−inf where not visible), visible [T, 1] -> bool [T, L]: rows of the kept blocks."""
    width = scores.shape[-1]
    blocks = F.pad(scores, (0, -width % block), value=-torch.inf).unflatten(-1, (-1, block)).amax(dim=-1)
    n = blocks.shape[-1]
    newest = (visible - 1) // block
    blocks = blocks.masked_fill(torch.arange(n, device=scores.device) == newest, torch.inf)
    top = top_indices(blocks, min(top_blocks, n), sort=True)
    keep = torch.zeros_like(blocks, dtype=torch.bool).scatter_(-1, top, blocks.gather(-1, top) > -torch.inf)
    return keep.repeat_interleave(block, dim=-1)[..., :width]


class Indexer:
    def __init__(self, cfg: V41Config, role: LayerRole, w: IndexerWeights, rotary: Rotary):
        self.cfg, self.role, self.w, self.rotary = cfg, role, w, rotary
        self.heads, self.head_dim = cfg.index_n_heads, cfg.index_head_dim
        self.keys = f"index_keys.{role.key_source}"
        self.weight_scale = self.head_dim ** -0.5 * self.heads ** -0.5

    def store_keys(self, latents: list[tuple[int, torch.Tensor]], segments) -> None:
        """Each session's new latents -> its index keys (one linear over all of them)."""
        rows = torch.cat([latent for _, latent in latents])
        if rows.shape[0] == 0:
            return
        k_all = rms_norm(linear(rows, self.w.wk), self.w.k_norm, self.cfg.norm_eps)
        at = 0
        for (g0, latent), s in zip(latents, segments):
            n = latent.shape[0]
            if n:
                pos = torch.arange(g0, g0 + n, device=latent.device) * self.role.ratio
                k = fp4_qdq(self.rotary.rotate(k_all[at:at + n], pos), 32, e4m3_scale=False)
                s.extra["buffers"](self.keys)[g0:g0 + n] = k
            at += n

    def topk(self, x: torch.Tensor, qr: torch.Tensor, positions: torch.Tensor, segments) -> list[torch.Tensor]:
        """Per segment, int64 [n, k] compressed row indices (−1 = none) for its queries. Official:
        k = min(index_topk, end // ratio) (none before the first row exists); batched: always
        index_topk, −1 padded."""
        q = linear(qr, self.w.wq_b).unflatten(-1, (self.heads, self.head_dim))
        q = fp4_qdq(self.rotary.rotate(q, positions), 32, e4m3_scale=False)
        weights = linear(x, self.w.weights_proj) * self.weight_scale
        batched = sum_order.batch_invariant()
        return [self._segment_topk(q[s.a:s.b], weights[s.a:s.b], positions[s.a:s.b], s, batched) for s in segments]

    def _segment_topk(self, q, weights, positions, s, batched: bool) -> torch.Tensor:
        r, step = self.role.ratio, s.extra["step"]
        n_rows = s.end // r
        width = self.cfg.index_topk if batched else min(self.cfg.index_topk, n_rows)
        if n_rows == 0:
            return torch.full((q.shape[0], width), -1, dtype=torch.int64, device=q.device)
        keys = s.extra["buffers"](self.keys)[:n_rows]
        if batched:  # each (query, head, key) product its own bits (kernels/dense_rows.py)
            score = dense_rows(q.flatten(0, 1), keys).to(keys.dtype).view(q.shape[0], self.heads, n_rows)
            score = (score.relu_() * weights.unsqueeze(-1)).sum(dim=1)
        else:
            score = torch.einsum("bshd,btd->bsht", q.unsqueeze(0), keys.unsqueeze(0))
            score = (score.relu_() * weights.unsqueeze(0).unsqueeze(-1)).sum(dim=2)[0]  # [T, n_rows] bf16
        visible = ((positions + 1) // r).unsqueeze(-1)
        score = score.masked_fill(torch.arange(n_rows, device=q.device) >= visible, -torch.inf)
        if self.role.candidate_source:
            step["candidates"] = select_candidate_blocks(score, visible, self.cfg.candidate_topk_blocks,
                                                         self.cfg.candidate_block_size)
        elif self.role.uses_candidates:
            score = score.masked_fill(~step["candidates"], -torch.inf)
        idx = top_indices(score, min(self.cfg.index_topk, n_rows)).sort(dim=-1).values
        idx = torch.where(idx < visible, idx, -1)
        return F.pad(idx, (0, width - idx.shape[1]), value=-1)
