"""`generate --image PATH` (repeatable): the images are read and checked before anything starts.

The prompt holds one image placeholder per --image, in order: the model's own
`<｜deepseek_image｜>`, or `<image>` as a shorthand that is easier to type.
"""
from __future__ import annotations

from engramflow.errors import EngramflowError
from engramflow.io.checkpoint import Checkpoint
from engramflow.model.vision import require_vision, vision_config
from engramflow.model.vision import ImageError
from engramflow.model.vision import prepare_any
from engramflow.pipeline.image_inputs import IMAGE_PLACEHOLDER

SHORTHAND = "<image>"


def cli_images(checkpoint: str, prompt: str, paths: list[str] | None) -> tuple[str, list | None]:
    """(the prompt with shorthands replaced, the prepared images or None); a bad image or a
    placeholder count that does not match raises (exit status 2)."""
    if not paths:
        return prompt, None
    prompt = prompt.replace(SHORTHAND, IMAGE_PLACEHOLDER)
    n = prompt.count(IMAGE_PLACEHOLDER)
    if n != len(paths):
        raise ImageError("placeholder_count", f"the prompt has {n} image placeholder(s) ({SHORTHAND} or "
                                              f"{IMAGE_PLACEHOLDER}) but {len(paths)} --image given")
    ckpt = Checkpoint(checkpoint)
    try:
        cfg = vision_config(ckpt)
    finally:
        ckpt.close()
    require_vision(cfg)
    try:
        return prompt, [prepare_any(p, cfg, p) for p in paths]
    except ImageError:
        raise
    except EngramflowError as e:
        raise ImageError("bad_source", str(e)) from None
