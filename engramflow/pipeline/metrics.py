"""Pipeline metrics through Ray's metrics API (`ray.util.metrics`): exported with the cluster's
other metrics (Prometheus / the dashboard) when Ray runs its metrics agent.

  engramflow_step_ms               histogram: wall time of one pipeline step (prefill chunk or decode)
  engramflow_exposed_wait_ms       histogram per Engram layer: time a stage waited for its K/V

(Recovery, recovery.py, counts and exports its own events: engramflow_recovery_total.)

`snapshot()` keeps the same numbers locally (counts and sums), for tests and reports.
"""
from __future__ import annotations

from collections import defaultdict

from ray.util.metrics import Histogram

_BOUNDS_MS = [0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 5000]


class PipelineMetrics:
    def __init__(self):
        self.step_ms = Histogram("engramflow_step_ms", "wall time of one pipeline step", boundaries=_BOUNDS_MS)
        self.wait_ms = Histogram("engramflow_exposed_wait_ms", "Engram K/V wait exposed to a stage",
                                 boundaries=_BOUNDS_MS, tag_keys=("layer",))
        self._local: dict[str, float] = defaultdict(float)

    def step(self, ms: float, waits: dict[int, float]) -> None:
        self.step_ms.observe(ms)
        self._local["steps"] += 1
        self._local["step_ms"] += ms
        for layer, wait in waits.items():
            self.wait_ms.observe(wait, tags={"layer": str(layer)})
            self._local[f"wait_ms.{layer}"] += wait

    def snapshot(self) -> dict[str, float]:
        return dict(self._local)
