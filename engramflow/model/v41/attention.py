"""V4.1 attention of one layer (docs/v41.md, "Attention"): q LoRA, one shared 512-d KV head (K = V),
partial RoPE, a sliding window plus (ratio > 0) top-k compressed rows, a per-head sink, the
inverse RoPE on the output and the grouped o-LoRA projection.

A forward covers the rows of one or more sessions (Segments): the projections take every row
at once; the caches, the compressor's pooling and the indexer's scores are each session's own.

Attention lists, by numerics:
* official: the list of a query at position p in a forward that ends at `end` is the one a
  one-shot prefill of tokens 0..end−1 gives it: min(window, end) window slots ending at p (−1
  before position 0), then min(index_topk, end // ratio) compressed rows. A decode step at t
  builds exactly the list of the last query of a prefill over 0..t (docs/v41.md, "Caches and
  decode"), but a row inside a chunk gets a list shaped by the chunk's end;
* batched: a query's list depends on its position alone: always `window` slots (−1 before
  position 0) and always `index_topk` compressed entries (−1 padded). With every other op
  row-invariant, a row's bits then do not depend on the chunk it came in or the sessions beside
  it; the lists of every session's rows are gathered and attended in one call.
Every layer reads its sources' caches by layer id, not "whatever was published last".
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engramflow.kernels import sum_order
from engramflow.kernels.quant import fp8_qdq
from engramflow.model.v41.compressor import Compressor
from engramflow.model.v41.config import LayerRole, V41Config
from engramflow.model.v41.indexer import Indexer
from engramflow.model.v41.ops import grouped_projection, linear, rms_norm
from engramflow.model.v41.rope import Rotary
from engramflow.model.v41.sparse_attention import QUERY_CHUNK, attend_rows, sparse_attention


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


def positions(segments, device) -> torch.Tensor:
    """int64 [rows]: each row's position in its session."""
    return torch.cat([torch.arange(s.start, s.end, device=device) for s in segments])


class Attention:
    def __init__(self, cfg: V41Config, role: LayerRole, w: AttentionWeights, rotary: Rotary,
                 compressor: Compressor | None, indexer: Indexer | None):
        self.cfg, self.role, self.w, self.rotary = cfg, role, w, rotary
        self.compressor, self.indexer = compressor, indexer
        self.window = f"window.{role.layer}"
        self.rows = f"compressed.{role.kv_source}"
        self.scale = cfg.head_dim ** -0.5

    def __call__(self, x: torch.Tensor, segments) -> torch.Tensor:
        """x [rows, dim] bf16 (the normed collapse) of the segments' rows -> [rows, dim] bf16."""
        cfg, w = self.cfg, self.w
        pos = positions(segments, x.device)
        qr = rms_norm(linear(x, w.wq_a), w.q_norm, cfg.norm_eps)
        q = self.rotary.rotate(linear(qr, w.wq_b).unflatten(-1, (cfg.n_heads, cfg.head_dim)), pos)
        kv = fp8_qdq(self.rotary.rotate(rms_norm(linear(x, w.wkv), w.kv_norm, cfg.norm_eps), pos))
        for s in segments:
            s.extra["buffers"](self.window)[s.start:s.end] = kv[s.a:s.b]
        topk = self._compressed(x, qr, pos, segments) if self.role.ratio else [None] * len(segments)
        if sum_order.batch_invariant():
            o = self._attend_by_position(q, segments, topk)
        else:
            o = torch.cat([self._attend_official(q[s.a:s.b], s, idx) for s, idx in zip(segments, topk)])
        o = self.rotary.rotate(o, pos, inverse=True)
        groups = cfg.o_groups
        o = grouped_projection(o.view(x.shape[0], groups, -1), w.wo_a.view(groups, cfg.o_lora_rank, -1))
        return linear(o.flatten(1), w.wo_b)

    def _attend_official(self, q, s, idx):
        """The official lists of one session's rows: shaped by where its forward ends."""
        buffers, end = s.extra["buffers"], s.end
        lists = [window_list(torch.arange(s.start, end, device=q.device), end, self.cfg.window_size)]
        rows = [buffers(self.window)[:end]]
        if self.role.ratio:
            rows.append(buffers(self.rows)[:end // self.role.ratio])
            lists.append(torch.where(idx >= 0, idx + end, -1))
        return sparse_attention(q, torch.cat(rows), self.w.sink, torch.cat(lists, dim=1), self.scale)

    def _attend_by_position(self, q, segments, topk):
        """Position-defined lists, gathered per session, attended QUERY_CHUNK queries per call
        (many sessions' decode rows share a call; a long prefill takes several)."""
        out, pending, count = torch.empty_like(q), [], 0

        def flush():
            rows = torch.cat([r for _, r, _ in pending])
            valid = torch.cat([v for _, _, v in pending])
            a = pending[0][0].start
            out[a:a + rows.shape[0]] = attend_rows(q[a:a + rows.shape[0]], rows, valid, self.w.sink, self.scale)
            pending.clear()

        for s, idx in zip(segments, topk):
            buffers = s.extra["buffers"]
            for r0 in range(0, s.n, QUERY_CHUNK):
                r1 = min(r0 + QUERY_CHUNK, s.n)
                pos = torch.arange(s.start + r0, s.start + r1, device=q.device)
                win = window_list(pos, self.cfg.window_size, self.cfg.window_size)
                rows, valid = [buffers(self.window)[win.clamp_min(0)]], [win >= 0]
                if self.role.ratio:
                    rows.append(buffers(self.rows)[idx[r0:r1].clamp_min(0)])
                    valid.append(idx[r0:r1] >= 0)
                if count + (r1 - r0) > QUERY_CHUNK:
                    flush()
                    count = 0
                pending.append((slice(s.a + r0, s.a + r1), torch.cat(rows, dim=1), torch.cat(valid, dim=1)))
                count += r1 - r0
        if pending:
            flush()
        return out

    def _compressed(self, x, qr, pos, segments) -> list[torch.Tensor]:
        """Writes this layer's compressed rows (a KV source) and index keys (a key owner); returns
        each segment's top-k list [n, k] of compressed rows (−1 = none)."""
        role = self.role
        if self.compressor is not None:
            latents = self.compressor.latents(x, segments)
            if self.indexer is not None and role.owns_keys:
                self.indexer.store_keys(latents, segments)
            self.compressor.store(latents, segments)
        if self.indexer is not None:
            lists = self.indexer.topk(x, qr, pos, segments)
        else:
            lists = [s.extra["step"]["topk"][role.index_source] for s in segments]
        if role.indexes:
            for s, idx in zip(segments, lists):
                s.extra["step"].setdefault("topk", {})[role.layer] = idx
        return lists
