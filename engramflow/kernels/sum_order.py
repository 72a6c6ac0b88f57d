"""How the reference quantised linear (kernels/quant.py) orders its block sums, the fact both
it and the native kernel (kernels/block_scaled.py) follow so that they give the same bits."""
from __future__ import annotations

import os

from engramflow.kernels.formats import BLOCK

# partial products held at once: nb * M * N_chunk fp32 values (64 MiB)
PARTIAL_BUDGET = 16 << 20
# One row summed as in a batch (see quant_linear_reference): then a row's bits never depend on
# the rows beside it, but one-row results leave the golden (official CPU) decode bits.
BATCH_INVARIANT = os.environ.get("ENGRAMFLOW_BATCH_INVARIANT") == "1"


def gemv_columns(nb: int) -> int:
    """Output columns one bmm takes for a one-row call (the reference's N chunk)."""
    return max(BLOCK, PARTIAL_BUDGET // max(1, nb))
