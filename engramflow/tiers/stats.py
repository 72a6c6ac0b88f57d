"""Per-tier counters and latency histograms.

A plain-python `TierStats` is always kept (tests and benchmarks read it directly). When the
process runs inside Ray, every update is mirrored to `ray.util.metrics` so the dashboard /
Prometheus see the same numbers, tagged by tier and layer.
"""
from __future__ import annotations

import bisect
import sys
import threading

# Bucket upper bounds in microseconds: roughly 1-2-5 log spacing from 1 µs to 10 s, wide
# enough for hot-cache gathers (µs) and cold SSD tails (ms).
BOUNDS_US: tuple[float, ...] = tuple(m * 10.0**e for e in range(0, 7) for m in (1, 2, 5)) + (1e7,)

COUNTERS = ("requests", "rows", "hits", "misses", "fallbacks", "retries", "errors", "rejects")


class LatencyHistogram:
    """Fixed-bucket histogram of durations (seconds in, microsecond buckets inside)."""

    def __init__(self, bounds_us: tuple[float, ...] = BOUNDS_US):
        self.bounds_us = bounds_us
        self.counts = [0] * (len(bounds_us) + 1)  # last bucket: above the largest bound
        self.count = 0
        self.total_s = 0.0
        self.max_s = 0.0

    def add(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(self.bounds_us, seconds * 1e6)] += 1
        self.count += 1
        self.total_s += seconds
        if seconds > self.max_s:
            self.max_s = seconds

    def add_many(self, seconds) -> None:
        """Many samples at once (an array of seconds)."""
        import numpy as np
        s = np.asarray(seconds, np.float64).reshape(-1)
        if not s.size:
            return
        idx = np.searchsorted(np.asarray(self.bounds_us), s * 1e6, side="left")
        self.counts = [a + b for a, b in zip(self.counts, np.bincount(idx, minlength=len(self.counts)).tolist())]
        self.count += int(s.size)
        self.total_s += float(s.sum())
        self.max_s = max(self.max_s, float(s.max()))

    def quantile(self, q: float) -> float:
        """Upper bound (seconds) of the bucket holding the q-quantile; 0 when empty."""
        if not self.count:
            return 0.0
        rank, seen = q * self.count, 0
        for i, c in enumerate(self.counts):
            seen += c
            if seen >= rank and c:
                return self.bounds_us[i] / 1e6 if i < len(self.bounds_us) else self.max_s
        return self.max_s

    def to_dict(self) -> dict:
        return {"count": self.count, "mean_us": 1e6 * self.total_s / self.count if self.count else 0.0,
                "max_us": 1e6 * self.max_s, "p50_us_le": 1e6 * self.quantile(0.5),
                "p99_us_le": 1e6 * self.quantile(0.99),
                "buckets_us": {str(b): c for b, c in zip(self.bounds_us + ("inf",), self.counts) if c}}


class TierStats:
    """Counters (see COUNTERS) plus a fetch-latency histogram for one tier of one layer."""

    def __init__(self, tier: str, layer: int | None = None):
        self.tier, self.layer = tier, layer
        self._lock = threading.Lock()  # SSD readers and server threads update concurrently
        self.counters = dict.fromkeys(COUNTERS, 0)
        self.latency = LatencyHistogram()
        self._ray = _ray_metrics()
        self._tags = {"tier": tier, "layer": str(layer)}

    def add(self, name: str, n: int = 1) -> None:
        if name not in self.counters:
            raise KeyError(f"unknown tier counter {name!r}; known: {', '.join(COUNTERS)}")
        with self._lock:
            self.counters[name] += n
        if self._ray and n:
            self._ray["counters"].inc(n, tags=self._tags | {"kind": name})

    def add_many(self, **counts: int) -> None:
        """Several counters under one lock acquisition (the hot path counts hits and misses together)."""
        with self._lock:
            for name, n in counts.items():
                self.counters[name] += n
        if self._ray:
            for name, n in counts.items():
                if n:
                    self._ray["counters"].inc(n, tags=self._tags | {"kind": name})

    def record(self, seconds: float, rows: int) -> None:
        """One served request: its latency, and the requests/rows counters."""
        with self._lock:
            self.latency.add(seconds)
            self.counters["requests"] += 1
            self.counters["rows"] += rows
        if self._ray:
            self._ray["latency"].observe(seconds * 1e3, tags=self._tags)
            self._ray["counters"].inc(1, tags=self._tags | {"kind": "requests"})
            if rows:
                self._ray["counters"].inc(rows, tags=self._tags | {"kind": "rows"})

    def observe(self, seconds: float) -> None:
        with self._lock:
            self.latency.add(seconds)
        if self._ray:
            self._ray["latency"].observe(seconds * 1e3, tags=self._tags)

    def __getitem__(self, name: str) -> int:
        return self.counters[name]

    def reset(self) -> None:
        with self._lock:
            self.counters = dict.fromkeys(COUNTERS, 0)
            self.latency = LatencyHistogram()

    def to_dict(self) -> dict:
        with self._lock:
            return {"tier": self.tier, "layer": self.layer, **self.counters, "latency": self.latency.to_dict()}


_RAY_METRICS: dict | None = None


def _ray_metrics() -> dict | None:
    """The process-wide Ray metric objects, created once, only when Ray is running here."""
    global _RAY_METRICS
    if _RAY_METRICS is not None:
        return _RAY_METRICS or None
    ray = sys.modules.get("ray")  # never import Ray just to ask: inside Ray it is already loaded
    if ray is None:
        return None
    try:
        if not ray.is_initialized():
            return None  # not cached: Ray may start later in this process
        from ray.util import metrics
        tags = ("tier", "layer")
        _RAY_METRICS = {
            "counters": metrics.Counter("engramflow_tier_events", "tier events (hits, misses, fallbacks, ...)",
                                        tag_keys=tags + ("kind",)),
            "latency": metrics.Histogram("engramflow_tier_fetch_ms", "per-tier fetch latency (ms)",
                                         boundaries=[b / 1e3 for b in BOUNDS_US], tag_keys=tags),
        }
    except Exception:  # metrics are best effort: never let them break a fetch
        _RAY_METRICS = {}
    return _RAY_METRICS or None
