"""A server's configuration: one replica's pipeline (pipeline/config.py) and what the API allows.

`engramflow serve` builds it from its options, a `serve run` config (serve.yaml) from the
application's args, both through `ServeConfig.build`: the same keywords (the fields here, and
PipelineConfig.build's), the same checks, before any replica starts.
"""
from __future__ import annotations

import dataclasses

from engramflow.errors import EngramflowError
from engramflow.pipeline.config import (EMULATION_KEYS, ENGINE_KEYS, PIPELINE_KEYS, EngineConfig, PipelineConfig,
                                        UnknownOption)
from engramflow.serve.limits import Limits
from engramflow.serve.prefix_budget import check_prefix_cache_mb
from engramflow.validate import check_int

MAX_SESSIONS = 1 << 16


@dataclasses.dataclass(frozen=True)
class ServeConfig:
    pipeline: PipelineConfig  # each replica's pipeline (or, in_process, its engine)
    model: str = "engramflow"  # the model name clients send
    max_sessions: int = 64  # requests decoded at once per replica
    max_queue: int = 256  # requests waiting per replica before a 429
    in_process: bool = False  # the Engine instead of a Pipeline (one process, no stage actors)
    api_key: str | None = None  # compared in constant time; read from a key file by the CLI
    allow_remote_images: bool = False  # fetch http(s) image_url parts (a server-side request a client names)
    max_body_bytes: int = Limits.max_body_bytes
    max_messages: int = Limits.max_messages
    max_images: int = Limits.max_images
    max_image_pixels: int = Limits.max_image_pixels
    prepare_workers: int = 2  # threads preparing requests (parse, tokenize, images) off the event loop
    prepare_queue: int = 64  # requests waiting for one of them before a 429
    max_n: int = 16  # choices per request (n), each a session of its own
    prefix_cache_mb: float | None = None  # retired sessions kept for their prefix (None: sized from the stages, 0: off)

    def __post_init__(self) -> None:
        if not isinstance(self.pipeline, PipelineConfig):
            raise EngramflowError(f"pipeline must be a PipelineConfig, got {self.pipeline!r}")
        for name, lo, hi in (("max_sessions", 1, MAX_SESSIONS), ("max_queue", 0, 1 << 20), ("max_n", 1, 1024),
                             ("max_body_bytes", 1024, 1 << 34), ("max_messages", 1, 1 << 20),
                             ("max_images", 0, 1 << 16), ("max_image_pixels", 1, 1 << 40),
                             ("prepare_workers", 1, 1024), ("prepare_queue", 0, 1 << 20)):
            check_int(name, getattr(self, name), lo, hi)
        object.__setattr__(self, "prefix_cache_mb", check_prefix_cache_mb(self.prefix_cache_mb))
        for name in ("in_process", "allow_remote_images"):
            if not isinstance(getattr(self, name), bool):
                raise EngramflowError(f"{name} must be True or False, got {getattr(self, name)!r}")
        for name in ("model", "api_key"):
            if not isinstance(getattr(self, name), str) and (name == "model" or getattr(self, name) is not None):
                raise EngramflowError(f"{name} must be a string, got {getattr(self, name)!r}")

    @property
    def engine(self) -> EngineConfig:
        return self.pipeline.engine

    @property
    def checkpoint(self) -> str:
        return self.pipeline.engine.checkpoint

    @property
    def limits(self) -> Limits:
        return Limits(self.max_body_bytes, self.max_messages, self.max_images, self.max_image_pixels)

    @classmethod
    def build(cls, checkpoint, **options) -> "ServeConfig":
        """From flat keywords (serve.yaml's args, the CLI's options): this class's fields, and
        the rest PipelineConfig.build's (stages, backbone, projection, max_restarts, ...)."""
        own = {k: options.pop(k) for k in list(options) if k in SERVE_KEYS}
        try:
            pipeline = PipelineConfig.build(checkpoint, **options)
        except UnknownOption as e:  # name what is known too
            raise UnknownOption(f"{e}; known: {', '.join(sorted(KNOWN))}") from None
        return cls(pipeline, **own)


SERVE_KEYS = {f.name for f in dataclasses.fields(ServeConfig)} - {"pipeline"}
KNOWN = SERVE_KEYS | ENGINE_KEYS | EMULATION_KEYS | PIPELINE_KEYS | {"checkpoint"}
