"""The vision keys of a V4.1 config.json, checked (errors name the key).

`vision_n_layers` 0 (the default) means a text-only checkpoint: no ViT, no aligner, no image
delimiters, no `bias_vl`. The other defaults are the official code's.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from engramflow.errors import EngramflowError

# limits of our own, not the model's: an image must be decodable without risk and must make sense
MAX_DECODE_PIXELS = 64_000_000  # header-declared width x height above this is refused before decoding
MAX_ASPECT = 200  # longer side / shorter side


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    n_layers: int
    dim: int
    n_heads: int
    inter_dim: int
    patch_size: int
    rope_theta: float
    downsample_ratio: int
    max_n_token: int
    min_pixels: int
    max_wh_ratio: int | None
    image_token_id: int
    text_dim: int
    max_decode_pixels: int = MAX_DECODE_PIXELS
    max_aspect: float = MAX_ASPECT

    @property
    def enabled(self) -> bool:
        return self.n_layers > 0

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


def _raw(raw: dict, key: str, default: Any) -> Any:
    inner = raw.get("vision_config") if isinstance(raw.get("vision_config"), dict) else {}
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else {}
    return inner.get(key, text.get(key, raw.get(key, default)))


def _int(raw: dict, key: str, default: int, minimum: int) -> int:
    v = _raw(raw, key, default)
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise EngramflowError(f"V4.1 config key {key!r} must be an integer >= {minimum}, got {v!r}")
    return v


def vision_from_dict(raw: dict[str, Any], text_dim: int) -> VisionConfig:
    theta = _raw(raw, "vision_rope_theta", 10000.0)
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not theta > 0:
        raise EngramflowError(f"V4.1 config key 'vision_rope_theta' must be a number > 0, got {theta!r}")
    ratio = _raw(raw, "vision_max_wh_ratio", None)
    if ratio is not None and (isinstance(ratio, bool) or not isinstance(ratio, int) or ratio < 1):
        raise EngramflowError(f"V4.1 config key 'vision_max_wh_ratio' must be null or an integer >= 1, got {ratio!r}")
    c = VisionConfig(
        n_layers=_int(raw, "vision_n_layers", 0, 0), dim=_int(raw, "vision_dim", 1024, 1),
        n_heads=_int(raw, "vision_n_heads", 16, 1), inter_dim=_int(raw, "vision_inter_dim", 2816, 1),
        patch_size=_int(raw, "vision_patch_size", 14, 1), rope_theta=float(theta),
        downsample_ratio=_int(raw, "vision_downsample_ratio", 3, 1),
        max_n_token=_int(raw, "vision_max_n_token", 1024, 5), min_pixels=_int(raw, "vision_min_pixels", 544 * 544, 0),
        max_wh_ratio=ratio, image_token_id=_int(raw, "image_token_id", 129264, 0), text_dim=text_dim)
    if c.enabled and (c.dim % c.n_heads or c.head_dim % 4):
        raise EngramflowError(f"V4.1 config key 'vision_n_heads'={c.n_heads}: vision_dim={c.dim} / heads must be a "
                              f"multiple of 4 (two rotary halves, each split between rows and columns)")
    return c
