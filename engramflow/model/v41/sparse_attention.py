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

LIST_BLOCK = 64
QUERY_CHUNK = 128  # queries per pass: bounds the gathered [chunk, 64, D] rows


def sparse_attention(q: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor, idx: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """q [T, H, D] bf16, kv [N, D] bf16, sink [H] fp32, idx [T, L] int64 -> [T, H, D] bf16."""
    out = torch.empty_like(q)
    for t0 in range(0, q.shape[0], QUERY_CHUNK):
        t1 = min(t0 + QUERY_CHUNK, q.shape[0])
        out[t0:t1] = _attend(q[t0:t1], kv, sink, idx[t0:t1], scale)
    return out


def _attend(q, kv, sink, idx, scale):
    t, h, d = q.shape
    qf = q.float().unsqueeze(0)  # a batch axis of 1, as the official kernel's shapes
    kvf = kv.float()
    scale_t = torch.tensor(scale, dtype=torch.float32, device=q.device)
    acc = torch.zeros(1, t, h, d, dtype=torch.float32, device=q.device)
    denom = torch.zeros(1, t, h, dtype=torch.float32, device=q.device)
    run_max = torch.full((1, t, h), -1e30, dtype=torch.float32, device=q.device)
    for b0 in range(0, idx.shape[1], LIST_BLOCK):
        blk = idx[:, b0:b0 + LIST_BLOCK].unsqueeze(0)
        valid = blk != -1
        rows = kvf[blk.clamp_min(0)] * valid.unsqueeze(-1)  # [1, t, k, d], invalid rows zero
        s = torch.einsum("bmhd,bmkd->bmhk", qf, rows)
        s = torch.where(valid.unsqueeze(2), s, -torch.inf) * scale_t
        prev = run_max
        run_max = torch.maximum(prev, s.amax(dim=-1))
        rescale = torch.exp(prev - run_max)
        p = torch.exp(s - run_max.unsqueeze(-1))
        denom = denom * rescale + p.sum(dim=-1)
        acc = acc * rescale.unsqueeze(-1) + torch.einsum("bmhk,bmkd->bmhd", p.to(torch.bfloat16).float(), rows)
    denom = denom + torch.exp(sink.float() - run_max)
    return (acc / denom.unsqueeze(-1)).to(torch.bfloat16)[0]
