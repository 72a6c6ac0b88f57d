"""Where each Engram layer is projected, step by step: on the table host or on the stage.

* `host`: the projection actor looks the rows up and projects them; K/V (fp32, 102,400 B per
  token per layer at the released shapes) go to the stage. It runs while the stage computes its
  earlier blocks, so only its overshoot is exposed (docs/architecture.md, "Timing model").
* `stage`: the actor ships the rows as stored (MXFP8, 6,336 B per token per layer); the stage
  decodes and projects them with its own copy of wkv, on its critical path.
* `auto`: per step and layer, the cheaper of the two by `PlacementModel`, from measured rates.

`PlacementModel` is a pure function of measured numbers (nothing about hardware is baked in):

    host  = max(0, host(T) + link(kv_bytes(T)) - lead)
    stage = max(0, link(row_bytes(T)) - lead) + stage(T)

where host(T) / stage(T) are each side's projection seconds for T positions (`ProjectionRate`:
a GEMV floor, then seconds per position), link(n) is latency + n / bandwidth, and lead is the
backbone time before the stage reaches the layer (`BackboneClock`, learned from the steps; 0
until one is seen). The stage wins only when it is cheaper by more than `margin` (a fraction of
the host's cost) plus `min_gain_s` (about one Ray hop: smaller gains are noise): host projection
is the incumbent, since it runs beside the backbone and leaves the device free for it.

The model is per layer: it ignores that layers projected at once on one actor share its cores.
Where the stage computes on the very cores of the projection actor (a CPU stage on the table
host's node, as on a one-node install) the pipeline gives both sides the same measured rate:
the projection work is then the same either way, and what decides is what can be hidden behind
the backbone (lead) and the bytes moved, not the noise between two measurements of one CPU.
"""
from __future__ import annotations

import bisect
import dataclasses
import math

from engramflow.errors import EngramflowError

MODES = ("host", "stage", "auto")


def check_projection_mode(mode) -> str:
    if mode not in MODES:
        raise EngramflowError(f"projection must be one of {', '.join(MODES)}; got {mode!r}")
    return mode


def _positive(name: str, value, allow_zero: bool = True) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value < 0 or (value == 0 and not allow_zero):
        raise EngramflowError(f"{name} must be a finite number {'>=' if allow_zero else '>'} 0, got {value!r}")
    return float(value)


@dataclasses.dataclass(frozen=True)
class ProjectionRate:
    """Seconds one side takes to project T positions: max(decode_s, T * per_token_s)."""
    decode_s: float  # one position: the weight-streaming GEMV (and the call's fixed costs)
    per_token_s: float  # the prefill regime: seconds per position of the GEMM

    def __post_init__(self):
        _positive("decode_s", self.decode_s)
        _positive("per_token_s", self.per_token_s, allow_zero=False)

    def seconds(self, tokens: int) -> float:
        return max(self.decode_s, tokens * self.per_token_s)

    @classmethod
    def measured(cls, m: dict) -> "ProjectionRate":
        """From `model.projection_calibration.measure`'s dict."""
        return cls(float(m["decode_s"]), float(m["per_token_s"]))

    @classmethod
    def hardware(cls, flops: float, bytes_per_s: float, weight_bytes: float, flop_per_token: float,
                 overhead_s: float = 0.0) -> "ProjectionRate":
        """From figures: GEMM FLOP/s, weight read bytes/s, wkv bytes, FLOP per position."""
        _positive("flops", flops, allow_zero=False)
        _positive("bytes_per_s", bytes_per_s, allow_zero=False)
        return cls(overhead_s + weight_bytes / bytes_per_s, flop_per_token / flops)


@dataclasses.dataclass(frozen=True)
class LinkRate:
    """What moving n bytes from the table host to a stage costs: latency + n / bandwidth."""
    latency_s: float
    bytes_per_s: float

    def __post_init__(self):
        _positive("latency_s", self.latency_s)
        _positive("bytes_per_s", self.bytes_per_s, allow_zero=False)

    def seconds(self, nbytes: float) -> float:
        return self.latency_s + nbytes / self.bytes_per_s


@dataclasses.dataclass(frozen=True)
class Costs:
    host_s: float  # exposed seconds if the host projects
    stage_s: float  # ... if the stage projects
    host_bytes: int  # bytes shipped to the stage if the host projects (K/V)
    stage_bytes: int  # ... if the stage projects (rows)


class PlacementModel:
    """The decision, as a pure function of measured rates (see the module docstring)."""

    def __init__(self, host: ProjectionRate, stage: ProjectionRate, link: LinkRate, kv_bytes_per_token: int,
                 rows_bytes_per_token: int, margin: float = 0.02, min_gain_s: float = 1e-3):
        self.host, self.stage, self.link = host, stage, link
        self.kv_bytes_per_token, self.rows_bytes_per_token = int(kv_bytes_per_token), int(rows_bytes_per_token)
        self.margin = _positive("margin", margin)
        self.min_gain_s = _positive("min_gain_s", min_gain_s)

    def costs(self, tokens: int, lead_s: float = 0.0) -> Costs:
        kv, rows = tokens * self.kv_bytes_per_token, tokens * self.rows_bytes_per_token
        host = max(0.0, self.host.seconds(tokens) + self.link.seconds(kv) - lead_s)
        stage = max(0.0, self.link.seconds(rows) - lead_s) + self.stage.seconds(tokens)
        return Costs(host, stage, kv, rows)

    def choose(self, tokens: int, lead_s: float = 0.0) -> str:
        c = self.costs(tokens, lead_s)
        return "stage" if c.stage_s < c.host_s * (1.0 - self.margin) - self.min_gain_s else "host"

    def describe(self) -> dict:
        return {"host": dataclasses.asdict(self.host), "stage": dataclasses.asdict(self.stage),
                "link": dataclasses.asdict(self.link), "kv_bytes_per_token": self.kv_bytes_per_token,
                "rows_bytes_per_token": self.rows_bytes_per_token, "margin": self.margin, "min_gain_s": self.min_gain_s}


class BackboneClock:
    """Backbone seconds of a step by its token count, learned from measured steps (the step's wall
    time less its exposed Engram waits); a step of an unseen size takes the nearest seen size's
    time (by log T), scaled linearly above the largest seen."""

    def __init__(self):
        self._seen: dict[int, float] = {}
        self._sizes: list[int] = []

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens < 1 or not math.isfinite(seconds) or seconds < 0:
            return
        if tokens not in self._seen:
            bisect.insort(self._sizes, tokens)
        old = self._seen.get(tokens)
        self._seen[tokens] = seconds if old is None else 0.5 * (old + seconds)  # smooth the noise

    def seconds(self, tokens: int) -> float:
        if not self._sizes:
            return 0.0
        near = min(self._sizes, key=lambda s: abs(math.log(s) - math.log(max(tokens, 1))))
        scale = tokens / near if tokens > self._sizes[-1] else 1.0
        return self._seen[near] * scale


class ProjectionPlacement:
    """The per-step choice for every Engram layer: `choose(layer, tokens)` -> "host" | "stage".

    `model` is required for "auto"; `lead_fraction[layer]` is the share of a step's backbone time
    spent before the layer (layer / n_layers). Counts of each choice per layer are kept."""

    def __init__(self, mode: str, model: PlacementModel | None = None, lead_fraction: dict[int, float] | None = None):
        self.mode = check_projection_mode(mode)
        if mode == "auto" and model is None:
            raise EngramflowError("projection='auto' needs measured rates (a PlacementModel)")
        self.model = model
        self.lead_fraction = dict(lead_fraction or {})
        self.clock = BackboneClock()
        self.measured: dict = {}  # what calibration measured (reports)
        self.counts: dict[int, dict[str, int]] = {}

    def choose(self, layer: int, tokens: int) -> str:
        if self.mode != "auto":
            choice = self.mode
        else:
            lead = self.lead_fraction.get(layer, 0.0) * self.clock.seconds(tokens)
            choice = self.model.choose(tokens, lead)
        per = self.counts.setdefault(layer, {"host": 0, "stage": 0})
        per[choice] += 1
        return choice

    def observe(self, tokens: int, backbone_s: float) -> None:
        self.clock.observe(tokens, backbone_s)
