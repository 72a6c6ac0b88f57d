"""Image figures for bench_v41.py, on the small checkpoint with a vision tower (tests/data/v41_vision):
* encode time per image at three resolutions (preprocessing: decode + resize + patches; tower: ViT +
  aligner + span rows), with the token limit raised so each resolution keeps its own grid;
* prefill of a text prompt with vs without an image in it (same text, best of `repeat`).
"""
from __future__ import annotations

import dataclasses
import io
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from common import timed
from engramflow.model.v41.vision.preprocess import prepare_image
from engramflow.pipeline.engine import Engine

VISION = Path(__file__).resolve().parent.parent / "tests" / "data" / "v41_vision"
RESOLUTIONS = (224, 448, 896)


def _png(side: int) -> bytes:
    rng = np.random.default_rng(side)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8), "RGB").save(buf, "PNG")
    return buf.getvalue()


def _best(fn, repeat: int) -> float:
    return min(timed(fn, repeat))


def image_figures(repeat: int, text_tokens: int = 60) -> dict:
    engine = Engine(VISION, backbone="v41")
    try:
        enc = engine.vision
        wide = dataclasses.replace(enc.cfg, max_n_token=4096)  # keep each resolution's own grid
        encode = []
        for side in RESOLUTIONS:
            data = _png(side)
            img = prepare_image(data, wide)
            pre_s = _best(lambda: prepare_image(data, wide), repeat)
            tower_s = _best(lambda: enc.span_rows(img), repeat)
            encode.append({"pixels": f"{side}x{side}", "patches": img.patches.shape[0], "span tokens": img.span_tokens,
                           "preprocess ms": pre_s * 1e3, "tower ms": tower_s * 1e3})
        ids = torch.randint(0, 500, (text_tokens,), generator=torch.Generator().manual_seed(0)).tolist()
        token = enc.cfg.image_token_id
        with_image = ids[: text_tokens // 2] + [token] + ids[text_tokens // 2:]
        image = VISION / "images" / "big.png"
        span = enc.prepare(image).span_tokens

        def prefill(prompt, images):
            s = engine.open()
            engine.prefill(s, prompt, images=images)
            engine.close(s)

        text_s = _best(lambda: prefill(ids, None), repeat)
        image_s = _best(lambda: prefill(with_image, [image]), repeat)
        prefill_rows = [{"prompt": f"{text_tokens} text tokens", "tokens": text_tokens, "prefill ms": text_s * 1e3},
                        {"prompt": f"same + one {span}-token image", "tokens": text_tokens + span,
                         "prefill ms": image_s * 1e3}]
        return {"encode": encode, "prefill": prefill_rows}
    finally:
        engine.shutdown()
