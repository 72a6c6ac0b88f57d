"""Serving metrics through Ray's metrics API (exported with the cluster's other metrics):

  engramflow_serve_ttft_ms             histogram: time to first token
  engramflow_serve_itl_ms              histogram: inter-token latency
  engramflow_serve_queue_length        gauge: requests waiting for a session
  engramflow_serve_running_sessions    gauge: requests being prefilled or decoded
  engramflow_serve_engram_wait_ms      histogram per Engram layer: exposed wait of a step
  engramflow_serve_drafted_tokens      counter: tokens the draft layers proposed (speculative decoding)
  engramflow_serve_accepted_tokens     counter: ... of them the verification kept (acceptance = their ratio)
"""
from __future__ import annotations

from ray.util.metrics import Counter, Gauge, Histogram

_BOUNDS_MS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000]


class ServeMetrics:
    def __init__(self):
        self.ttft = Histogram("engramflow_serve_ttft_ms", "time to first token", boundaries=_BOUNDS_MS)
        self.itl = Histogram("engramflow_serve_itl_ms", "inter-token latency", boundaries=_BOUNDS_MS)
        self.queue = Gauge("engramflow_serve_queue_length", "requests waiting for a session")
        self.running = Gauge("engramflow_serve_running_sessions", "requests being prefilled or decoded")
        self.wait = Histogram("engramflow_serve_engram_wait_ms", "Engram K/V wait exposed to a stage",
                              boundaries=_BOUNDS_MS, tag_keys=("layer",))
        self.drafted = Counter("engramflow_serve_drafted_tokens", "tokens drafted by the DSpark layers")
        self.accepted = Counter("engramflow_serve_accepted_tokens", "drafted tokens the verification kept")

    def first_token(self, ms: float) -> None:
        self.ttft.observe(ms)

    def inter_token(self, ms: float) -> None:
        self.itl.observe(ms)

    def load(self, waiting: int, running: int, **_) -> None:
        self.queue.set(waiting)
        self.running.set(running)

    def step(self, waits: dict[int, float]) -> None:
        for layer, ms in waits.items():
            self.wait.observe(ms, tags={"layer": str(layer)})

    def speculative(self, drafted: int, accepted: int) -> None:
        if drafted:  # Ray's Counter refuses 0
            self.drafted.inc(drafted)
        if accepted:
            self.accepted.inc(accepted)
