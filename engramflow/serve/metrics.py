"""Serving metrics through Ray's metrics API (exported with the cluster's other metrics):

  engramflow_serve_ttft_ms             histogram: time to first token
  engramflow_serve_itl_ms              histogram: inter-token latency
  engramflow_serve_queue_length        gauge: requests waiting for a session
  engramflow_serve_running_sessions    gauge: requests being prefilled or decoded
  engramflow_serve_engram_wait_ms      histogram per Engram layer: exposed wait of a step
  engramflow_serve_drafted_tokens      counter: tokens the draft layers proposed (speculative decoding)
  engramflow_serve_accepted_tokens     counter: ... of them the verification kept (acceptance = their ratio)
  engramflow_serve_prefix_cache_hits   counter: requests that forked a cached prefix
  engramflow_serve_prefix_cached_tokens  counter: prompt tokens taken from it (not prefilled)
  engramflow_serve_prefix_cache_evictions  counter: cached sessions dropped for the budget
  engramflow_serve_prefix_cache_bytes  gauge: what the cached sessions hold (every stage, history, log)
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
        self.prefix = {k: Counter(f"engramflow_serve_prefix_{name}", doc) for k, name, doc in (
            ("hits", "cache_hits", "requests that forked a cached prefix"),
            ("cached_tokens", "cached_tokens", "prompt tokens taken from the prefix cache"),
            ("evictions", "cache_evictions", "cached sessions dropped for the budget"))}
        self.prefix_bytes = Gauge("engramflow_serve_prefix_cache_bytes", "bytes the prefix cache's sessions hold")
        self._prefix_seen = dict.fromkeys(self.prefix, 0)  # the scheduler's totals already counted

    def first_token(self, ms: float) -> None:
        self.ttft.observe(ms)

    def inter_token(self, ms: float) -> None:
        self.itl.observe(ms)

    def load(self, waiting: int, running: int, prefix_cache: dict | None = None, **_) -> None:
        self.queue.set(waiting)
        self.running.set(running)
        if prefix_cache is not None:  # the scheduler keeps totals: count what is new since the last step
            for k, counter in self.prefix.items():
                if prefix_cache[k] > self._prefix_seen[k]:  # Ray's Counter refuses 0
                    counter.inc(prefix_cache[k] - self._prefix_seen[k])
                    self._prefix_seen[k] = prefix_cache[k]
            self.prefix_bytes.set(prefix_cache["bytes"])

    def step(self, waits: dict[int, float]) -> None:
        for layer, ms in waits.items():
            self.wait.observe(ms, tags={"layer": str(layer)})

    def speculative(self, drafted: int, accepted: int) -> None:
        if drafted:  # Ray's Counter refuses 0
            self.drafted.inc(drafted)
        if accepted:
            self.accepted.inc(accepted)
