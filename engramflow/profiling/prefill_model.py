"""Prefill timing model: TTFT for a prompt with Engram projected on the host or on the stages.

A prompt of P tokens is prefilled in chunks of C. Per chunk of c tokens the backbone takes
W(c) = backbone_ms_per_chunk + c * backbone_ms_per_token (the whole model); Engram layer l is
reached l / n_layers of the way through it, later by whatever earlier layers stalled it (the
"chained" form of the decode model, docs/architecture.md).

* host: each layer's K/V are ready at share * (gather(c) + host(c)) + link(kv_bytes(c)) from the
  chunk's start, where `share` is the number of Engram layers one projection actor serves
  concurrently on the same cores (1 with one actor per layer: a 2-socket host; 2 on one
  package). The stage waits only for the part past the moment it reaches the layer.
* stage: rows are ready at share * gather(c) + link(rows_bytes(c)); the stage then decodes and projects
  them on its device, on its critical path: device(c) each.

host(c) and device(c) are max(wkv_bytes / GB/s, c * FLOP per token / FLOP/s) (a GEMV floor, then
the GEMM); link(n) = latency + n / bandwidth. Each chunk also pays one hop per stage boundary
(`link_latency_ms`). `serial` TTFT sums the chunk steps (this runner: one step at a time).
`pipelined` TTFT lets chunks follow each other through the stages (micro-batches in flight):
the first chunk's step, then one bottleneck interval per further chunk: the largest of a
stage's share of the backbone plus its own Engram work, and the host's projection of a chunk.
"""
from __future__ import annotations

import dataclasses
import math

from engramflow.errors import EngramflowError

PLACEMENTS = ("host", "stage")


@dataclasses.dataclass(frozen=True)
class PrefillFigures:
    host_gflops: float  # GEMM rate of one projection actor (its package's cores), GFLOP/s
    host_gbps: float  # memory read bandwidth of one projection actor, GB/s
    device_tflops: float  # the stage device's projection GEMM rate, TFLOP/s
    link_gbps: float  # table host -> stage, GB/s
    link_latency_ms: float  # per transfer / hop
    stages: int = 1
    device_gbps: float = 3000.0  # device memory bandwidth (its GEMV floor)
    backbone_ms_per_chunk: float = 0.0  # whole model, per forward (emulated: n_layers * block_ms)
    backbone_ms_per_token: float = 0.0  # whole model, per token
    host_share: int = 2  # Engram layers one projection actor projects at once (1: one actor per layer)
    gather_us_per_token: float = 15.0  # host row gather of one layer, per token
    device_decode_gbps: float = 0.0  # stage row decode (bytes of rows / s); 0: free (folded into the GEMM)
    chunk: int = 512
    n_layers: int = 40
    engram_layers: tuple[int, ...] = (1, 14)
    kv_bytes_per_token: int = 102_400  # fp32 K/V as shipped: 25,600 values
    rows_bytes_per_token: int = 6_336  # 24 MXFP8 rows of 264 B
    flop_per_token: float = 2 * 25_600 * 6_144
    wkv_bytes: float = 25_600 * 6_144  # FP8

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name == "engram_layers":
                if not v or any(not 0 <= l < self.n_layers for l in v):
                    raise EngramflowError(f"engram_layers must lie in [0, n_layers={self.n_layers}), got {v!r}")
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise EngramflowError(f"{f.name} must be a finite number >= 0, got {v!r}")
        for name in ("host_gflops", "host_gbps", "device_tflops", "device_gbps", "link_gbps"):
            if getattr(self, name) <= 0:
                raise EngramflowError(f"{name} must be > 0, got {getattr(self, name)!r}")
        for name in ("stages", "chunk", "n_layers", "host_share"):
            if int(getattr(self, name)) != getattr(self, name) or getattr(self, name) < 1:
                raise EngramflowError(f"{name} must be an integer >= 1, got {getattr(self, name)!r}")

    # seconds -> ms helpers, per chunk of c tokens
    def host_ms(self, c: int) -> float:
        return 1e3 * max(self.wkv_bytes / (self.host_gbps * 1e9), c * self.flop_per_token / (self.host_gflops * 1e9))

    def device_ms(self, c: int) -> float:
        decode = c * self.rows_bytes_per_token / (self.device_decode_gbps * 1e9) if self.device_decode_gbps else 0.0
        gemm = max(self.wkv_bytes / (self.device_gbps * 1e9), c * self.flop_per_token / (self.device_tflops * 1e12))
        return 1e3 * (decode + gemm)

    def link_ms(self, nbytes: float) -> float:
        return self.link_latency_ms + 1e3 * nbytes / (self.link_gbps * 1e9)

    def backbone_ms(self, c: int) -> float:
        return self.backbone_ms_per_chunk + c * self.backbone_ms_per_token


def chunk_ms(fig: PrefillFigures, c: int, placement: str) -> tuple[float, float]:
    """(step ms of one chunk of c tokens, ms one projection actor is busy with it)."""
    w = fig.backbone_ms(c)
    gather = c * fig.gather_us_per_token / 1e3
    host_busy = fig.host_share * (gather + (fig.host_ms(c) if placement == "host" else 0.0))
    delay = 0.0
    for layer in sorted(fig.engram_layers):
        reach = w * layer / fig.n_layers + delay
        if placement == "host":
            delay += max(0.0, host_busy + fig.link_ms(c * fig.kv_bytes_per_token) - reach)
        else:
            delay += max(0.0, host_busy + fig.link_ms(c * fig.rows_bytes_per_token) - reach) + fig.device_ms(c)
    return w + delay + fig.stages * fig.link_latency_ms, host_busy


def ttft_ms(fig: PrefillFigures, prompt_tokens: int, placement: str, pipelined: bool = False) -> float:
    if placement not in PLACEMENTS:
        raise EngramflowError(f"placement must be one of {', '.join(PLACEMENTS)}; got {placement!r}")
    if isinstance(prompt_tokens, bool) or not isinstance(prompt_tokens, int) or prompt_tokens < 1:
        raise EngramflowError(f"prompt length must be an integer >= 1, got {prompt_tokens!r}")
    sizes = [fig.chunk] * (prompt_tokens // fig.chunk) + ([prompt_tokens % fig.chunk] if prompt_tokens % fig.chunk else [])
    steps = [chunk_ms(fig, c, placement) for c in sizes]
    if not pipelined or len(steps) == 1:
        return sum(s for s, _ in steps)
    total = steps[0][0]
    for c, (step, host_busy) in zip(sizes[1:], steps[1:]):
        stage_share = (step - fig.stages * fig.link_latency_ms) / fig.stages + fig.link_latency_ms
        total += max(stage_share, host_busy)
    return total


@dataclasses.dataclass(frozen=True)
class PrefillPrediction:
    prompt_tokens: int
    placement: str
    ttft_ms: float
    pipelined: bool


def predict_prefill(fig: PrefillFigures, prompt_lengths, pipelined: bool = False) -> list[PrefillPrediction]:
    return [PrefillPrediction(p, pl, ttft_ms(fig, p, pl, pipelined), pipelined)
            for p in prompt_lengths for pl in PLACEMENTS]
