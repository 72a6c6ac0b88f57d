"""Which numerics a computation runs in, and how the reference quantised linear (kernels/quant.py)
orders its block sums (the fact both it and the native kernel, kernels/block_scaled.py, follow).

Two numerics, named:
* "batched" (the default): a step's sessions share one forward, and every op keeps each row's
  arithmetic fixed whatever the number of rows (kernels/dense_rows.py for the dense linears, the
  block sums j in order for one row as for many, attention lists defined by a query's position),
  so a session's bits never depend on its company or on how its prompt was chunked;
* "official": per-session forwards with the official code's shapes and torch's own GEMMs, bit for
  bit the official V4.1 code on the same CPU (a one-row block sum in MKL's GEMV order, a chunk's
  attention lists as its one-shot prefill builds them).
A component runs its work inside `use(mode)`; code outside any `use` gets the process default,
ENGRAMFLOW_NUMERICS or "batched".
"""
from __future__ import annotations

import contextlib
import contextvars
import os

from engramflow.errors import EngramflowError
from engramflow.kernels.formats import BLOCK

NUMERICS = ("batched", "official")
# partial products held at once: nb * M * N_chunk fp32 values (64 MiB)
PARTIAL_BUDGET = 16 << 20

_current: contextvars.ContextVar[str | None] = contextvars.ContextVar("engramflow_numerics", default=None)


def check_numerics(value) -> str:
    if value not in NUMERICS:
        raise EngramflowError(f"numerics must be one of {', '.join(NUMERICS)}, got {value!r}")
    return value


def default_numerics() -> str:
    """ENGRAMFLOW_NUMERICS, or "batched"."""
    value = os.environ.get("ENGRAMFLOW_NUMERICS") or "batched"
    if value not in NUMERICS:
        raise EngramflowError(f"ENGRAMFLOW_NUMERICS must be one of {', '.join(NUMERICS)}, got {value!r}")
    return value


def resolve(numerics: str | None) -> str:
    """An explicit choice (checked), else the process default."""
    return default_numerics() if numerics is None else check_numerics(numerics)


def current() -> str:
    return _current.get() or default_numerics()


def batch_invariant() -> bool:
    """Whether the code running now must keep each row's bits independent of the others."""
    return current() == "batched"


@contextlib.contextmanager
def use(numerics: str):
    token = _current.set(check_numerics(numerics))
    try:
        yield
    finally:
        _current.reset(token)


def gemv_columns(nb: int) -> int:
    """Output columns one bmm takes for a one-row call (the reference's N chunk)."""
    return max(BLOCK, PARTIAL_BUDGET // max(1, nb))
