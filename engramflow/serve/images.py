"""A chat request's images: OpenAI `image_url` parts -> prepared images, checked before the
request is queued. `data:` URLs only, unless the operator allowed remote ones; any bad image
is a 400 with OpenAI's error body naming the part."""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from engramflow.errors import EngramflowError
from engramflow.model.v41.vision.errors import ImageError
from engramflow.model.v41.vision.sources import load_image_from_data_url
from engramflow.pipeline.image_inputs import expand, prepare_images, text_with_images
from engramflow.serve.errors import bad


def chat_images(runner, prompt: str, encode: Callable[[str], list[int]], urls: list[str], allow_remote: bool
                ) -> tuple[list[int], list, list[int]]:
    """(the prompt's ids with one placeholder id per image, the prepared images, the ids as the
    model reads them: each placeholder expanded to its image's span)."""
    try:
        ids = text_with_images(prompt, encode, runner.vision_cfg)
        data = []
        for k, url in enumerate(urls):
            try:
                data.append(load_image_from_data_url(url, allow_remote=allow_remote))
            except ImageError as e:
                raise bad(f"image {k + 1}: {e}", "messages", e.kind) from None
        images = prepare_images(data, runner.vision_cfg)
        expanded = expand(np.asarray(ids, dtype=np.int64), images, runner.vision_cfg, runner.cfg.max_seq_len, 0)[0]
    except ImageError as e:
        raise bad(str(e), "messages", e.kind) from None
    except EngramflowError as e:  # a checkpoint without a vision tower
        raise bad(str(e), "messages", "images_not_supported") from None
    return ids, images, [int(t) for t in expanded]
