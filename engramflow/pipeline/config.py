"""One run's configuration, checked once: what the engine, the pipeline and the server are told.

    ServeConfig (serve/config.py)   model, max_sessions, max_queue, limits, prefix_cache_mb, ...
      pipeline: PipelineConfig      stages, address, in_flight, projection, placement_rates, policy, warmup
        engine: EngineConfig        checkpoint, backbone, prefill_chunk, numerics, speculative, tiers,
                                    device (the in-process Engine's), threads
          emulation: Emulation      the emulated backbone's block_ms and the projection actor's
                                    delay_ms: test and benchmark knobs, apart from the rest

Every value is checked when a config is made (`__post_init__`), by an error that names the
field and the value. Nothing here reads the checkpoint: what needs its files (the token map,
the stage split, the draft layers, the tiers' layers) launch.py checks, before any actor.
`numerics` None reads ENGRAMFLOW_NUMERICS once, where the config is made (the driver), so
every actor gets the same explicit choice; `threads` None reads ENGRAMFLOW_THREADS the same
way. The configs are frozen (`dataclasses.replace` makes a variant) and pickle (replicas and
actors get them).

The keyword forms -- `Pipeline.launch("ckpt", stages=2)`, `Engine("ckpt", block_ms=0)`,
`serve.yaml`'s args, the CLI's options -- all go through `build`: the one place that maps
keywords onto fields. An unknown keyword is an `UnknownOption` (a TypeError and an
EngramflowError) naming it.
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from engramflow.errors import EngramflowError
from engramflow.kernels import sum_order
from engramflow.model.backbones import KINDS
from engramflow.pipeline.in_flight import check_in_flight
from engramflow.pipeline.placement_calibration import check_rates
from engramflow.pipeline.projection_placement import check_projection_mode
from engramflow.pipeline.recovery import RecoveryPolicy
from engramflow.pipeline.speculative import SpeculativeOptions, parse_speculative
from engramflow.validate import check_int, check_number

MAX_BLOCK_MS = 1000.0  # emulated backbone: a second per block is already far slower than any real block


class UnknownOption(EngramflowError, TypeError):
    """A keyword no config field takes (a TypeError, as Python's own for a bad keyword)."""


@dataclasses.dataclass(frozen=True)
class Emulation:
    """The emulated backbone's and projection actor's knobs (overlap experiments, tests, benchmarks)."""
    block_ms: float = 1.0  # emulated backbone: the time each block sleeps
    projection_delay_ms: dict | None = None  # Engram layer -> ms the projection actor adds to each projection

    def __post_init__(self) -> None:
        check_number("block_ms", self.block_ms, 0, MAX_BLOCK_MS, unit="a number of ms")
        delays = self.projection_delay_ms
        if delays is not None and (not isinstance(delays, dict) or not all(
                isinstance(k, int) and not isinstance(k, bool) for k in delays)):
            raise EngramflowError(f"projection_delay_ms must map Engram layer ids to ms, got {delays!r}")
        for layer, ms in (delays or {}).items():
            check_number(f"projection_delay_ms[{layer}]", ms, 0, MAX_BLOCK_MS, unit="a number of ms")


def threads_from_env() -> int | None:
    """ENGRAMFLOW_THREADS (a count >= 1), or None: each process computes with the cores it may use.
    Fewer threads than cores help where processes share the cores (several actors or servers on
    one small host): each parallel op otherwise waits for a thread the OS has not scheduled."""
    value = os.environ.get("ENGRAMFLOW_THREADS") or None
    if value is not None and not (value.isdigit() and int(value) >= 1):
        raise EngramflowError(f"ENGRAMFLOW_THREADS must be a whole number >= 1, got {value!r}")
    return int(value) if value is not None else None


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """The model one runner runs: the in-process Engine, or each stage of a Pipeline."""
    checkpoint: str  # the checkpoint folder (made absolute)
    backbone: str | None = None  # None: v41 for a V4.1 checkpoint, else reference (model/backbones.py)
    prefill_chunk: int = 512  # prompt tokens per prefill step
    numerics: str | None = None  # "batched" | "official" (kernels/sum_order.py); None: ENGRAMFLOW_NUMERICS
    speculative: str | None = None  # "dspark[:K][:exact][:adaptive[=P]]" (pipeline/speculative.py); None: off
    tiers: object = None  # a tiers dict or TiersConfig (tiers/config.py), checked against the checkpoint's layers
    device: str = "cpu"  # the Engine's torch device (pipeline stages pick their own)
    threads: int | None = None  # torch threads of each process computing for the runner: the Engine, each stage
    # actor, each projection actor (None: ENGRAMFLOW_THREADS, else the cores it may use or is pinned to)
    emulation: Emulation = Emulation()

    def __post_init__(self) -> None:
        if not isinstance(self.checkpoint, (str, os.PathLike)):
            raise EngramflowError(f"checkpoint must be a path, got {self.checkpoint!r}")
        object.__setattr__(self, "checkpoint", str(Path(self.checkpoint).resolve()))
        if self.backbone is not None and self.backbone not in KINDS:
            raise EngramflowError(f"unknown backbone {self.backbone!r}; choose one of {', '.join(KINDS)}")
        check_int("prefill_chunk", self.prefill_chunk, 1)
        object.__setattr__(self, "numerics", sum_order.resolve(self.numerics))
        if parse_speculative(self.speculative) is None:
            object.__setattr__(self, "speculative", None)  # "" and "off" read as off
        if not isinstance(self.device, str):
            raise EngramflowError(f"device must be a torch device name, got {self.device!r}")
        if self.threads is None:
            object.__setattr__(self, "threads", threads_from_env())
        if self.threads is not None:
            check_int("threads", self.threads, 1)
        if not isinstance(self.emulation, Emulation):
            raise EngramflowError(f"emulation must be an Emulation, got {self.emulation!r}")

    @property
    def spec(self) -> SpeculativeOptions | None:
        return parse_speculative(self.speculative)

    @classmethod
    def build(cls, checkpoint, **options) -> "EngineConfig":
        """From keywords: this class's fields and Emulation's."""
        return _engine(checkpoint, options)


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    """A Ray pipeline: its engine config and how it is spread over actors."""
    engine: EngineConfig
    stages: int = 1  # the backbone's blocks split evenly over this many stage actors
    address: str | None = None  # Ray address (None: a local instance)
    in_flight: int | None = None  # steps generate() keeps in flight (None: one per stage)
    projection: str = "host"  # where Engram layers are projected: host | stage | auto
    placement_rates: dict | None = None  # overrides of the rates measured at launch (projection auto)
    policy: RecoveryPolicy = dataclasses.field(default_factory=RecoveryPolicy)  # retries and actor restarts (pipeline/recovery.py)
    warmup: bool = False  # projection actors touch their tables at start

    def __post_init__(self) -> None:
        if not isinstance(self.engine, EngineConfig):
            raise EngramflowError(f"engine must be an EngineConfig, got {self.engine!r}")
        check_int("stages", self.stages, 1)
        if self.address is not None and not isinstance(self.address, str):
            raise EngramflowError(f"address must be a Ray address string, got {self.address!r}")
        if self.in_flight is not None:
            check_in_flight(self.in_flight)
        check_projection_mode(self.projection)
        check_rates(self.placement_rates)
        if not isinstance(self.policy, RecoveryPolicy):
            raise EngramflowError(f"policy must be a RecoveryPolicy, got {self.policy!r}")
        if not isinstance(self.warmup, bool):
            raise EngramflowError(f"warmup must be True or False, got {self.warmup!r}")

    @classmethod
    def build(cls, checkpoint, **options) -> "PipelineConfig":
        """From keywords: this class's fields (and `max_restarts`, the policy's), EngineConfig's
        and Emulation's."""
        own = _take(options, PIPELINE_KEYS)
        if "max_restarts" in own:
            if "policy" in own:
                raise EngramflowError("give either policy or max_restarts, not both")
            own["policy"] = RecoveryPolicy(max_restarts=own.pop("max_restarts"))
        return cls(_engine(checkpoint, options), **own)


def _names(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


EMULATION_KEYS = _names(Emulation)
ENGINE_KEYS = _names(EngineConfig) - {"checkpoint", "emulation"}
PIPELINE_KEYS = _names(PipelineConfig) - {"engine"} | {"max_restarts"}


def _take(options: dict, keys: set[str]) -> dict:
    """Remove and return the entries of `options` named in `keys`."""
    return {k: options.pop(k) for k in list(options) if k in keys}


def _engine(checkpoint, options: dict) -> EngineConfig:
    """The EngineConfig of `options` (emptied); anything left over is an UnknownOption."""
    engine = _take(options, ENGINE_KEYS)
    emulation = Emulation(**_take(options, EMULATION_KEYS))
    check_known(options)
    return EngineConfig(checkpoint, emulation=emulation, **engine)


def check_known(options: dict) -> None:
    if options:
        raise UnknownOption(f"unknown option{'s' if len(options) > 1 else ''} {', '.join(sorted(options))}")
