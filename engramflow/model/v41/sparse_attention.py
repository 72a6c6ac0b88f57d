"""Sparse single-KV-head attention with a per-head sink (docs/v41.md, "Attention").

Each query attends to its own list of KV rows (index −1 = none), processed in blocks of 64
list entries with an online softmax: running max from −1e30, fp32 denominators, and the
probabilities rounded to bf16 (relative to the running max) before the value product. The sink
adds exp(sink − max) to the denominator and no value. K = V. A query with no valid entry gives 0.
The list order therefore matters (block boundaries); callers build lists the way a one-shot
prefill would.
"""
from __future__ import annotations

import torch

from engramflow.kernels import rowwise

LIST_BLOCK = 64
QUERY_CHUNK = 128  # queries per pass: bounds the gathered [chunk, 64, D] rows


def sparse_attention(q: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor, idx: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """q [T, H, D] bf16, kv [N, D] bf16, sink [H] fp32, idx [T, L] int64 -> [T, H, D] bf16."""
    out = torch.empty_like(q)
    for t0 in range(0, q.shape[0], QUERY_CHUNK):
        lists = idx[t0:t0 + QUERY_CHUNK]
        out[t0:t0 + QUERY_CHUNK] = attend_rows(q[t0:t0 + QUERY_CHUNK], kv[lists.clamp_min(0)], lists != -1, sink, scale)
    return out


def attend_rows(q: torch.Tensor, rows: torch.Tensor, valid: torch.Tensor, sink: torch.Tensor,
                scale: float) -> torch.Tensor:
    """Each query over its own gathered rows: q [t, H, D] bf16, rows [t, L, D] bf16 (query i's
    list entries), valid bool [t, L] -> [t, H, D] bf16. Every query's arithmetic is its own
    (a batch axis over the queries), so queries of several sessions may share one call."""
    t, h, d = q.shape
    qf = q.float().unsqueeze(0)  # a batch axis of 1, as the official kernel's shapes
    scale_t = torch.tensor(scale, dtype=torch.float32, device=q.device)
    acc = torch.zeros(1, t, h, d, dtype=torch.float32, device=q.device)
    denom = torch.zeros(1, t, h, dtype=torch.float32, device=q.device)
    run_max = torch.full((1, t, h), -1e30, dtype=torch.float32, device=q.device)
    for b0 in range(0, rows.shape[1], LIST_BLOCK):
        ok = valid[:, b0:b0 + LIST_BLOCK].unsqueeze(0)
        blk = rows[:, b0:b0 + LIST_BLOCK].float().unsqueeze(0) * ok.unsqueeze(-1)  # [1, t, k, d], invalid rows zero
        s = torch.einsum("bmhd,bmkd->bmhk", qf, blk)
        s = torch.where(ok.unsqueeze(2), s, -torch.inf) * scale_t
        prev = run_max
        run_max = torch.maximum(prev, s.amax(dim=-1))
        rescale = rowwise.exp(prev - run_max)
        p = rowwise.exp(s - run_max.unsqueeze(-1))
        denom = denom * rescale + p.sum(dim=-1)
        acc = acc * rescale.unsqueeze(-1) + torch.einsum("bmhk,bmkd->bmhd", p.to(torch.bfloat16).float(), blk)
    denom = denom + rowwise.exp(sink.float() - run_max)
    return (acc / denom.unsqueeze(-1)).to(torch.bfloat16)[0]
