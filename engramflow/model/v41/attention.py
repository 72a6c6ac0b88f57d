"""V4.1 attention of one layer (docs/v41.md, "Attention"): q LoRA, one shared 512-d KV head (K = V),
partial RoPE, a sliding window plus (ratio > 0) top-k compressed rows, a per-head sink, the
inverse RoPE on the output and the grouped o-LoRA projection.

The attention list of a query at position p in a forward that ends at `end` is the one a
one-shot prefill of tokens 0..end−1 gives it: min(window, end) window slots ending at p (−1
before position 0), then min(index_topk, end // ratio) compressed rows. So a decode step at t
builds exactly the list of the last query of a prefill over 0..t, and decode is defined by
prefill (docs/v41.md, "Caches and decode") without the official decode path's index-key caveat: every layer reads
its sources' caches by layer id, not "whatever was published last".
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engramflow.kernels.quant import fp8_qdq
from engramflow.model.v41.compressor import Compressor
from engramflow.model.v41.config import LayerRole, V41Config
from engramflow.model.v41.indexer import Indexer
from engramflow.model.v41.ops import grouped_projection, linear, rms_norm
from engramflow.model.v41.rope import Rotary
from engramflow.model.v41.sparse_attention import sparse_attention


@dataclass
class AttentionWeights:
    wq_a: object           # QuantWeight [q_lora_rank, dim]
    q_norm: torch.Tensor
    wq_b: object           # QuantWeight [heads·head_dim, q_lora_rank]
    wkv: object            # QuantWeight [head_dim, dim]
    kv_norm: torch.Tensor
    wo_a: torch.Tensor     # bf16 [groups·o_lora_rank, heads·head_dim / groups]
    wo_b: object           # QuantWeight [dim, groups·o_lora_rank]
    sink: torch.Tensor     # fp32 [heads]


def window_list(positions: torch.Tensor, end: int, window: int) -> torch.Tensor:
    """int64 [T, min(window, end)]: window slots of each query, oldest first, −1 past the query."""
    n = min(window, end)
    idx = (positions.unsqueeze(1) - window + 1).clamp_min(0) + torch.arange(n, device=positions.device)
    return torch.where(idx > positions.unsqueeze(1), -1, idx)


class Attention:
    def __init__(self, cfg: V41Config, role: LayerRole, w: AttentionWeights, rotary: Rotary,
                 compressor: Compressor | None, indexer: Indexer | None):
        self.cfg, self.role, self.w, self.rotary = cfg, role, w, rotary
        self.compressor, self.indexer = compressor, indexer
        self.window = f"window.{role.layer}"
        self.rows = f"compressed.{role.kv_source}"
        self.scale = cfg.head_dim ** -0.5

    def __call__(self, x: torch.Tensor, start: int, buffers, step: dict) -> torch.Tensor:
        """x [T, dim] bf16 (the normed collapse) at positions start.. -> [T, dim] bf16."""
        cfg, w = self.cfg, self.w
        t, end = x.shape[0], start + x.shape[0]
        pos = torch.arange(start, end, device=x.device)
        qr = rms_norm(linear(x, w.wq_a), w.q_norm, cfg.norm_eps)
        q = self.rotary.rotate(linear(qr, w.wq_b).unflatten(-1, (cfg.n_heads, cfg.head_dim)), pos)

        kv = rms_norm(linear(x, w.wkv), w.kv_norm, cfg.norm_eps)
        buffers(self.window)[start:end] = fp8_qdq(self.rotary.rotate(kv, pos))
        lists = [window_list(pos, end, cfg.window_size)]
        rows = [buffers(self.window)[:end]]
        if self.role.ratio:
            compressed, idx = self._compressed(x, qr, pos, start, end, buffers, step)
            rows.append(compressed)
            lists.append(torch.where(idx >= 0, idx + end, -1))
        o = sparse_attention(q, torch.cat(rows), w.sink, torch.cat(lists, dim=1), self.scale)
        o = self.rotary.rotate(o, pos, inverse=True)
        groups = cfg.o_groups
        o = grouped_projection(o.view(t, groups, -1), w.wo_a.view(groups, cfg.o_lora_rank, -1))
        return linear(o.flatten(1), w.wo_b)

    def _compressed(self, x, qr, pos, start, end, buffers, step):
        """This layer's compressed rows [end // r, head_dim] and top-k list [T, k]."""
        role = self.role
        n_rows = end // role.ratio
        if self.compressor is not None:
            g0, latent = self.compressor.latents(x, start, buffers)
            if self.indexer is not None and role.owns_keys:
                self.indexer.store_keys(g0, latent, buffers)
            self.compressor.store(g0, latent, buffers)
        if n_rows == 0:
            idx = torch.empty(x.shape[0], 0, dtype=torch.int64, device=x.device)
        elif self.indexer is not None:
            idx = self.indexer.topk(x, qr, pos, end, buffers, step)
        else:
            idx = step["topk"][role.index_source]
        if role.indexes:
            step.setdefault("topk", {})[role.layer] = idx
        return buffers(self.rows)[:n_rows], idx
