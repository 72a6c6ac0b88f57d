"""`serve --prefix-cache-mb`: the prefix cache's byte budget per replica (docs/prefix_reuse.md,
"Prefix reuse"). Checked before Ray starts; the default is sized once the runner is up, from
what one cached token costs its stages (pipeline/token_cost.py)."""
from __future__ import annotations

import math

from engramflow.errors import EngramflowError

MAX_MB = 1 << 20  # 1 TiB: anything larger is a typo, not a cache
DEFAULT_CAP_MB_PER_STAGE = 1024  # the default never takes more than 1 GiB of any stage's memory
DEFAULT_CONTEXTS = 8  # ... nor more than 8 full contexts' worth of positions


def check_prefix_cache_mb(mb) -> float | None:
    """None (the default size), 0 (off) or a budget in MiB; anything else is refused, naming the value."""
    if mb is None:
        return None
    if isinstance(mb, bool) or not isinstance(mb, (int, float)) or not math.isfinite(mb) or not 0 <= mb <= MAX_MB:
        raise EngramflowError(f"--prefix-cache-mb must be a number of MiB in [0, {MAX_MB}] (0 turns the cache off), "
                              f"got {mb!r}")
    return float(mb)


def prefix_cache_bytes(mb: float | None, stage_token_bytes: list[int], max_seq_len: int) -> int:
    """The budget in bytes. Default: room for DEFAULT_CONTEXTS full contexts, at most
    DEFAULT_CAP_MB_PER_STAGE on the stage a token costs most (the budget counts every stage's
    bytes, so the cap scales with the stage count)."""
    if mb is not None:
        return int(mb * (1 << 20))
    per_token = sum(stage_token_bytes) + 16  # + history and log (token_cost.token_bytes)
    worst = max(stage_token_bytes, default=0)
    cap_tokens = (DEFAULT_CAP_MB_PER_STAGE << 20) // worst if worst else DEFAULT_CONTEXTS * max_seq_len
    return min(DEFAULT_CONTEXTS * max_seq_len, cap_tokens) * per_token
