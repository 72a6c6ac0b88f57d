"""The command line's options -> the configs (pipeline/config.py, serve/config.py): one mapping
for demo, generate, serve, prefill-job and profile. A command's namespace holds the options it
registered; the ones a config takes (`--block-ms` is `block_ms`) go to its `build`, which checks
them. A config's error names the field; here it names the flag the user typed instead.
"""
from __future__ import annotations

import contextlib
import re

from engramflow.errors import EngramflowError

# options a command may register that PipelineConfig.build takes (the rest are the command's own)
PIPELINE_OPTIONS = ("stages", "address", "backbone", "block_ms", "prefill_chunk", "projection", "speculative",
                    "in_flight", "device", "max_restarts")
SERVE_OPTIONS = ("model", "max_sessions", "max_queue", "in_process", "allow_remote_images", "max_body_bytes",
                 "max_images", "max_image_pixels", "max_n", "prefix_cache_mb")
_FIELD = re.compile(r"^([a-z][a-z_]*)(?= must |\[)")


def _given(args, names) -> dict:
    return {n: getattr(args, n) for n in names if hasattr(args, n)}


@contextlib.contextmanager
def as_flags():
    """A config error that starts with a field's name starts with its flag instead."""
    try:
        yield
    except EngramflowError as e:
        msg = str(e)
        flag = _FIELD.sub(lambda m: "--" + m.group(1).replace("_", "-"), msg, count=1)
        if flag == msg:
            raise
        raise EngramflowError(flag) from None


def pipeline_config(args, **override):
    """The PipelineConfig of a command's options (`override` wins over them)."""
    from engramflow.pipeline.config import PipelineConfig

    with as_flags():
        return PipelineConfig.build(args.checkpoint, **_given(args, PIPELINE_OPTIONS) | override)


def serve_config(args, **override):
    """The ServeConfig of `engramflow serve`'s options."""
    from engramflow.serve.config import ServeConfig

    with as_flags():
        return ServeConfig.build(args.checkpoint, **_given(args, PIPELINE_OPTIONS + SERVE_OPTIONS) | override)
