"""A chat request's images: OpenAI `image_url` parts -> prepared images, checked before the
request is queued. `data:` URLs only, unless the operator allowed remote ones; any bad image
is a 400 with OpenAI's error body naming the part. Runs in the prepare pool, never on the event
loop: every image's declared size is checked against the server's budget before any image is
decoded, and a remote fetch blocks only its worker."""
from __future__ import annotations

import numpy as np

from engramflow.errors import EngramflowError
from engramflow.model.vision import ImageError
from engramflow.model.vision import load_image_from_data_url
from engramflow.pipeline.image_inputs import expand, prepare_images
from engramflow.serve.errors import bad
from engramflow.serve.limits import Limits, check_image_size, declared_size


def image_token_id(runner) -> int:
    """The placeholder id of this checkpoint's images; a 400 when it takes none."""
    cfg = runner.vision_cfg
    if cfg is None or not cfg.enabled:
        raise bad("this checkpoint has no vision tower (vision_n_layers is 0): it takes no images", "messages",
                  "images_not_supported")
    return cfg.image_token_id


def chat_images(runner, ids: list[int], urls: list[str], allow_remote: bool, limits: Limits = Limits()
                ) -> tuple[list, list[int]]:
    """(the prepared images, the ids as the model reads them: each placeholder expanded to its
    image's span). `ids` holds one placeholder id per image, in order."""
    try:
        data = []
        for k, url in enumerate(urls):
            try:
                data.append(load_image_from_data_url(url, allow_remote=allow_remote))
            except ImageError as e:
                raise bad(f"image {k + 1}: {e}", "messages", e.kind) from None
            check_image_size(k, declared_size(data[-1]), limits)
        images = prepare_images(data, runner.vision_cfg)
        expanded = expand(np.asarray(ids, dtype=np.int64), images, runner.vision_cfg, runner.cfg.max_seq_len, 0)[0]
    except ImageError as e:
        raise bad(str(e), "messages", e.kind) from None
    except EngramflowError as e:  # a checkpoint without a vision tower
        raise bad(str(e), "messages", "images_not_supported") from None
    return images, [int(t) for t in expanded]
