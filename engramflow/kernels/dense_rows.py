"""The row-invariant dense linear of the default numerics: y = x @ Wᵀ with each row's arithmetic
fixed whatever the number of rows (block_scaled.c, `ebs_dense`).

torch's GEMM picks its summation order by shape (a GEMV for one row, blocked GEMMs for more,
other blockings for other row counts), so a row's bits would depend on how many rows share the
call: on which sessions share a step and on how a prompt is chunked. This kernel sums every
output the same way for any row count (16 FMA lanes in K order, then a fixed tree), reads the
weight once per call for all rows, and splits work across threads by whole tiles only.

x and W may each be fp32 or bf16 (bf16 widens exactly to fp32); the result is fp32, rounded by
the caller into the dtype the op needs. Without the native library (or off the CPU) each row
runs as its own one-row F.linear: still row-invariant, slower, other bits.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engramflow.kernels import block_scaled_lib, sum_order

MIN_MACS_PER_THREAD = 1 << 18  # below this a call runs on one thread (starting threads costs more)
_WIDE = (torch.float32, torch.bfloat16)


def dense_rows(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [..., K] · w [N, K]ᵀ -> fp32 [..., N], each row's bits independent of the others."""
    lead, k = x.shape[:-1], x.shape[-1]
    if w.shape[-1] != k:
        raise ValueError(f"dense_rows: x has width {k}, w is {list(w.shape)}")
    rows = x.reshape(-1, k)
    lib = block_scaled_lib.library() if x.device.type == "cpu" and w.device.type == "cpu" else None
    if lib is None:
        out = torch.cat([F.linear(r.float(), w.float()) for r in rows.split(1)]) if rows.shape[0] else \
            rows.new_zeros(0, w.shape[0], dtype=torch.float32)
        return out.view(*lead, w.shape[0])
    # the rows widened once here (exact): the kernel then widens only the weight stream
    rows = rows.float().contiguous()
    w = (w if w.dtype in _WIDE else w.float()).contiguous()
    n, m = w.shape[0], rows.shape[0]
    out = torch.empty(m, n, dtype=torch.float32)
    threads = max(1, min(torch.get_num_threads(), m * n * k // MIN_MACS_PER_THREAD))
    rc = lib.ebs_dense(rows.data_ptr(), int(rows.dtype == torch.bfloat16), m, k, w.data_ptr(),
                       int(w.dtype == torch.bfloat16), n, out.data_ptr(), threads)
    if rc != 0:
        raise ValueError(f"dense_rows: bad shape [{m}, {k}] x [{n}, {k}]")
    return out.view(*lead, n)


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.linear(x, weight) in weight's dtype; in batched numerics on the CPU by `dense_rows`
    (each row's bits its own), rounded once into weight's dtype. On an accelerator torch's
    GEMM runs either way: a GPU's batch invariance needs kernels of its own (not built yet)."""
    if sum_order.batch_invariant() and x.device.type == "cpu":
        return dense_rows(x.to(weight.dtype), weight).to(weight.dtype)
    return F.linear(x.to(weight.dtype), weight)
