"""Degraded operation: what a tier stack does when one tier fails.

* `fallback`: ask the next tier down (same bytes, only slower);
* `retry`: try the same tier again, a bounded number of times with exponential backoff, then
  `then` (reject by default, or fallback);
* `reject`: fail the request with a TierError that names the layer, tier and cause.

Only TierError (tier faults: lost connection, timeout, server error) triggers a policy. Bad
row ids are the caller's bug and are rejected before any tier is asked.
"""
from __future__ import annotations

import dataclasses
import time

from engramflow.errors import EngramflowError
from engramflow.tiers.source import RowStore, TierError
from engramflow.tiers.stats import TierStats

MODES = ("fallback", "retry", "reject")


@dataclasses.dataclass(frozen=True)
class Policy:
    mode: str = "fallback"
    retries: int = 2            # extra attempts for mode=retry
    backoff_s: float = 0.001    # first wait; doubles per attempt
    backoff_max_s: float = 0.05
    then: str = "reject"        # after retries are spent: reject or fallback

    def __post_init__(self):
        if self.mode not in MODES:
            raise EngramflowError(f"tier policy must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.then not in ("reject", "fallback"):
            raise EngramflowError(f"tier policy 'then' must be reject or fallback, got {self.then!r}")
        if not (isinstance(self.retries, int) and not isinstance(self.retries, bool) and 0 <= self.retries <= 100):
            raise EngramflowError(f"tier policy retries must be an integer in [0, 100], got {self.retries!r}")
        for key in ("backoff_s", "backoff_max_s"):
            v = getattr(self, key)
            if not isinstance(v, (int, float)) or isinstance(v, bool):
                raise EngramflowError(f"tier policy {key} must be a number of seconds, got {v!r}")
        if not (0 <= self.backoff_s <= self.backoff_max_s <= 10):
            raise EngramflowError(f"tier policy backoff must satisfy 0 <= backoff_s ({self.backoff_s}) "
                                  f"<= backoff_max_s ({self.backoff_max_s}) <= 10")

    @classmethod
    def parse(cls, spec) -> "Policy":
        """'fallback' | 'retry' | 'reject' | {'mode': ..., 'retries': ..., ...} | Policy."""
        if isinstance(spec, Policy):
            return spec
        if isinstance(spec, str):
            return cls(spec)
        if isinstance(spec, dict):
            unknown = set(spec) - {f.name for f in dataclasses.fields(cls)}
            if unknown:
                raise EngramflowError(f"unknown tier policy key(s) {sorted(unknown)}")
            return cls(**spec)
        raise EngramflowError(f"tier policy must be a string or a mapping, got {spec!r}")

    @property
    def attempts(self) -> int:
        return 1 + (self.retries if self.mode == "retry" else 0)

    @property
    def falls_through(self) -> bool:
        return self.mode == "fallback" or (self.mode == "retry" and self.then == "fallback")


class TierStack(RowStore):
    """Tiers tried in order, each under its policy. Every level must hold the same table."""

    def __init__(self, levels: list[tuple[RowStore, Policy | str | dict]], layer: int | None = None,
                 name: str = "stack"):
        if not levels:
            raise EngramflowError("a tier stack needs at least one tier")
        self.levels = [(src, Policy.parse(p)) for src, p in levels]
        first = self.levels[0][0]
        for src, _ in self.levels[1:]:
            if (src.rows, src.head_dim) != (first.rows, first.head_dim):
                raise EngramflowError(f"tier {src.name!r} holds {src.rows} rows x {src.head_dim}, but tier "
                                      f"{first.name!r} holds {first.rows} x {first.head_dim}: not the same table")
        last_src, last_pol = self.levels[-1]
        if last_pol.falls_through:
            raise EngramflowError(f"the last tier {last_src.name!r} has policy {last_pol.mode!r}"
                                  f"{' then fallback' if last_pol.mode == 'retry' else ''}, but there is no "
                                  "tier below it to fall back to")
        self.rows, self.head_dim = first.rows, first.head_dim
        self.layer, self.name = layer, name
        self.stats = TierStats(name, layer)

    def _run(self, call):
        """call(level) on the first level that answers, under the levels' policies."""
        for src, pol in self.levels:
            for attempt in range(pol.attempts):
                try:
                    return call(src)
                except TierError as e:
                    err = e
                    if attempt + 1 < pol.attempts:
                        _count(src, "retries")
                        time.sleep(min(pol.backoff_s * 2**attempt, pol.backoff_max_s))
            if pol.falls_through:
                _count(src, "fallbacks")
                continue
            _count(src, "rejects")
            raise TierError(f"layer {self.layer} tier {src.name!r} failed after {pol.attempts} attempt(s) "
                            f"(policy {pol.mode}): {err}") from err
        raise AssertionError("unreachable: the last tier never falls through")

    def _gather(self, ids):
        return self._run(lambda src: src._fetch(ids))

    def _gather_view(self, a):
        return self._run(lambda src: src._view(a))

    def _gather_tensors(self, ids, device):
        return self._run(lambda src: src._fetch_tensors(ids, device))

    @property
    def io_bound(self) -> bool:
        """The first tier decides how a lookup usually waits (prefetch.py)."""
        return bool(getattr(self.levels[0][0], "io_bound", False))

    def tier_stats(self) -> dict[str, dict]:
        return {src.name: src.stats.to_dict() for src, _ in self.levels if src.stats is not None}

    def close(self) -> None:
        for src, _ in self.levels:
            src.close()


def _count(src: RowStore, name: str) -> None:
    if src.stats is not None:
        src.stats.add(name)
