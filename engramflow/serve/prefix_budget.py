"""`serve --prefix-cache-mb`: the prefix cache's byte budget per replica (docs/prefix_reuse.md,
"Prefix reuse"). Checked before Ray starts; the default is sized once the runner is up, from
what one cached token costs its stages (model/token_cost.py)."""
from __future__ import annotations

import math

from engramflow.errors import EngramflowError
from engramflow.scheduling.prefix_reuse import default_budget_bytes

MAX_MB = 1 << 20  # 1 TiB: anything larger is a typo, not a cache


def check_prefix_cache_mb(mb) -> float | None:
    """None (the default size), 0 (off) or a budget in MiB; anything else is refused, naming the value."""
    if mb is None:
        return None
    if isinstance(mb, bool) or not isinstance(mb, (int, float)) or not math.isfinite(mb) or not 0 <= mb <= MAX_MB:
        raise EngramflowError(f"--prefix-cache-mb must be a number of MiB in [0, {MAX_MB}] (0 turns the cache off), "
                              f"got {mb!r}")
    return float(mb)


def prefix_cache_bytes(mb: float | None, stage_token_bytes: list[int], max_seq_len: int) -> int:
    """The budget in bytes; None: the scheduler's default (8 full contexts, at most 1 GiB on the
    stage a position costs most: prefix_reuse.default_budget_bytes)."""
    if mb is not None:
        return int(mb * (1 << 20))
    return default_budget_bytes(stage_token_bytes, max_seq_len)
