"""A prompt with images -> the token stream the model reads, checked before anything runs.

Each image placeholder id in the prompt (`image_token_id`, i.e. `<｜deepseek_image｜>` in text)
becomes the image's whole span: every position carries the placeholder id, is DEAD for Engram
and is routed with `bias_vl`; its embedding rows come from the vision tower (`ImageSlot`s whose
rows a backend computes: in process, or as an object ref from a vision actor). Images are
preprocessed here, on the driver: a bad image is refused before any session changes.
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

import numpy as np

from engramflow.chat.tokens import IMAGE
from engramflow.errors import EngramflowError
from engramflow.model.vision import ImageError, ImageSlot, PreparedImage, VisionConfig, prepare_any

IMAGE_PLACEHOLDER = IMAGE  # the chat format spells it the same


def prepare_images(images, cfg: VisionConfig | None) -> list[PreparedImage]:
    if images is None:
        return []
    if not isinstance(images, (list, tuple)):
        raise EngramflowError(f"images must be a list (bytes, paths or PIL images), got {type(images).__name__}")
    if images and (cfg is None or not cfg.enabled):
        raise EngramflowError("this checkpoint has no vision tower (vision_n_layers is 0): it takes no images")
    return [prepare_any(img, cfg, str(img)[:60] if isinstance(img, (str, os.PathLike)) else f"#{i + 1}")
            for i, img in enumerate(images)]


def text_with_images(text: str, encode: Callable[[str], list[int]], cfg: VisionConfig | None) -> list[int]:
    """Text -> ids with the model's image placeholder id wherever the text spells the placeholder:
    the id comes from the config, since tokenizer revisions spell that token differently."""
    if cfg is None or not cfg.enabled:
        raise EngramflowError("this checkpoint has no vision tower (vision_n_layers is 0): it takes no images")
    ids: list[int] = []
    for k, piece in enumerate(text.split(IMAGE_PLACEHOLDER)):
        if k:
            ids.append(cfg.image_token_id)
        if piece:
            ids += encode(piece)
    return ids


def expand(ids: np.ndarray, prepared: list[PreparedImage], cfg: VisionConfig | None, max_len: int, at: int
           ) -> tuple[np.ndarray, np.ndarray | None, list[tuple[int, PreparedImage]]]:
    """(expanded ids, DEAD mask, [(span start relative to the request, image)]). The number of
    placeholders must equal the number of images; the expanded prompt must fit the context."""
    token = None if cfg is None else cfg.image_token_id
    where = np.flatnonzero(ids == token) if token is not None else np.empty(0, dtype=np.int64)
    if len(where) != len(prepared):
        raise ImageError("placeholder_count", f"the prompt has {len(where)} image placeholder(s) (id {token}) "
                                              f"but {len(prepared)} image(s) were given")
    if not prepared:
        return ids, None, []
    total = ids.size + sum(p.span_tokens - 1 for p in prepared)
    if at + total > max_len:
        raise ImageError("too_many_tokens", f"the prompt with {len(prepared)} image(s) expands to {total} tokens "
                                            f"(images: {[p.span_tokens for p in prepared]}); from position {at} "
                                            f"that is above max_seq_len={max_len}")
    out, dead, spans, prev = [], [], [], 0
    length = 0
    for pos, img in zip(where, prepared):
        text = ids[prev:pos]
        out.append(text)
        dead.append(np.zeros(text.size, dtype=bool))
        length += text.size
        spans.append((length, img))
        out.append(np.full(img.span_tokens, token, dtype=np.int64))
        dead.append(np.ones(img.span_tokens, dtype=bool))
        length += img.span_tokens
        prev = pos + 1
    out.append(ids[prev:])
    dead.append(np.zeros(ids.size - prev, dtype=bool))
    return np.concatenate(out).astype(np.int64), np.concatenate(dead), spans


def encode_slots(spans: list[tuple[int, PreparedImage]], encode: Callable[[PreparedImage], object]) -> tuple[ImageSlot, ...]:
    """Hand each image to the backend's encoder (which may return at once with a reference)."""
    return tuple(ImageSlot(start, img.span_tokens, encode(img), 0, img) for start, img in spans)


def reencoded(requests: list, encode: Callable[[PreparedImage], object]) -> list:
    """The requests with every image encoded again from its source (after a fault the old rows'
    references may hold the error); pieces of one image share one new encoding."""
    out, fresh = [], {}
    for r in requests:
        if r.images:
            slots = []
            for s in r.images:
                if id(s.source) not in fresh:
                    fresh[id(s.source)] = encode(s.source)
                slots.append(dataclasses.replace(s, rows=fresh[id(s.source)]))
            r = dataclasses.replace(r, images=tuple(slots))
        out.append(r)
    return out


def history_writes(requests: list) -> list[tuple]:
    """The requests as the history actor needs them: (session, ids, start_pos, DEAD mask) as plain
    values, no image data and no request class (whose module would make that actor import torch)."""
    return [(r.session, r.ids, r.start_pos, r.dead) for r in requests]


def wire_slots(slots) -> tuple[ImageSlot, ...]:
    """What the stages receive: the rows reference, not the source patches."""
    return tuple(dataclasses.replace(s, source=None) for s in slots)
