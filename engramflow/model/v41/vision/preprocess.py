"""Image bytes -> the ViT's patches, as the official preprocessing computes them.

1. Open the header only and check it before any pixel is decoded: a known format, a size above
   zero, at most `max_decode_pixels` pixels (decompression bombs), an aspect ratio within
   `max_aspect`.
2. Decode and convert to RGB (alpha dropped, grayscale and palette expanded). The EXIF
   orientation tag is NOT applied: the official code feeds the stored pixel grid, so we do too.
3. Resize to the planned grid (grid.py): letterboxed on mid-grey (127) with the aspect kept, or
   stretched when the image is wider than `max_wh_ratio` allows.
4. Scale to [-1, 1] in fp32 ((x/255 - 0.5) / 0.5), round to bf16 and cut into patch_size^2
   patches in reading order: [vit_h * vit_w, 3, p, p].
"""
from __future__ import annotations

import dataclasses
import io
import struct
import warnings

import numpy as np
import torch

from engramflow.model.v41.vision.config import VisionConfig
from engramflow.model.v41.vision.errors import ImageError
from engramflow.model.v41.vision.grid import ImageGrid, plan_grid

FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")
GREY = (127, 127, 127)
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@dataclasses.dataclass(frozen=True)
class PreparedImage:
    patches: torch.Tensor  # bf16 [vit_h * vit_w, 3, p, p]
    grid: ImageGrid
    source_size: tuple[int, int]  # (width, height) as decoded

    @property
    def span_tokens(self) -> int:
        return self.grid.span_tokens


def _open(data: bytes, label: str):
    from PIL import Image, UnidentifiedImageError

    if not data:
        raise ImageError("not_an_image", f"image {label}: empty data")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            return Image.open(io.BytesIO(data), formats=None)
    except UnidentifiedImageError:
        if data[:8] == PNG_SIGNATURE and len(data) >= 24 and 0 in struct.unpack(">II", data[16:24]):
            w, h = struct.unpack(">II", data[16:24])
            raise ImageError("zero_size", f"image {label}: PNG header declares size {w}x{h}, no pixels") from None
        raise ImageError("not_an_image", f"image {label}: not an image Pillow recognises "
                                         f"(first bytes {data[:8]!r})") from None
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise ImageError("too_many_pixels", f"image {label}: {e}") from None
    except (OSError, SyntaxError, ValueError) as e:
        raise ImageError("corrupt", f"image {label}: cannot read the header: {e}") from None


def check_header(fmt: str | None, size: tuple[int, int], label: str, cfg: VisionConfig) -> None:
    """fmt None: an image decoded in memory (a PIL image passed in), no file format to check."""
    if fmt is not None and fmt not in FORMATS:
        raise ImageError("unsupported_format", f"image {label}: format {fmt} is not supported "
                                               f"(supported: {', '.join(FORMATS)})")
    w, h = size
    if w < 1 or h < 1:
        raise ImageError("zero_size", f"image {label}: size {w}x{h} has no pixels")
    if w * h > cfg.max_decode_pixels:
        raise ImageError("too_many_pixels", f"image {label}: {w}x{h} = {w * h} pixels is above the limit of "
                                            f"{cfg.max_decode_pixels} (checked before decoding)")
    if max(w, h) / min(w, h) > cfg.max_aspect:
        raise ImageError("aspect_ratio", f"image {label}: aspect ratio {w}x{h} is beyond {cfg.max_aspect:g}:1")


def decode_rgb(data: bytes, label: str, cfg: VisionConfig):
    """The checked, fully decoded RGB PIL image."""
    img = _open(data, label)
    with img:
        check_header(img.format or "?", img.size, label, cfg)
        try:
            img.load()
            return img.convert("RGB")
        except OSError as e:
            kind = "truncated" if "truncated" in str(e) else "corrupt"
            raise ImageError(kind, f"image {label}: cannot decode: {e}") from None
        except (SyntaxError, ValueError, EOFError) as e:
            raise ImageError("corrupt", f"image {label}: cannot decode: {e}") from None


def resize_to_grid(img, grid: ImageGrid, cfg: VisionConfig):
    from PIL import ImageOps

    size = (grid.width, grid.height)
    if cfg.max_wh_ratio is not None and img.width >= cfg.max_wh_ratio * img.height:
        return img.resize(size)
    return ImageOps.pad(img, size, color=GREY)


def to_patches(img, grid: ImageGrid, patch: int) -> torch.Tensor:
    x = torch.from_numpy(np.asarray(img, dtype=np.float32)).permute(2, 0, 1) / 255
    x = ((x - 0.5) / 0.5).to(torch.bfloat16)  # [3, H, W]
    x = x.reshape(3, grid.vit_h, patch, grid.vit_w, patch).permute(1, 3, 0, 2, 4)
    return x.reshape(grid.vit_h * grid.vit_w, 3, patch, patch)


def prepare_rgb(img, cfg: VisionConfig, label: str) -> PreparedImage:
    """A decoded RGB image -> its patches and grids."""
    grid = plan_grid(img.width, img.height, cfg)
    if grid.span_tokens > cfg.max_n_token or grid.vit_h < 1 or grid.vit_w < 1:
        raise ImageError("aspect_ratio", f"image {label}: {img.width}x{img.height} cannot be fitted into "
                                         f"{cfg.max_n_token} tokens")
    return PreparedImage(to_patches(resize_to_grid(img, grid, cfg), grid, cfg.patch_size), grid, img.size)


def prepare_image(data: bytes, cfg: VisionConfig, label: str = "") -> PreparedImage:
    """Bytes of an image file -> its patches and grids; a bad image raises ImageError."""
    label = label or f"({len(data)} bytes)"
    return prepare_rgb(decode_rgb(data, label, cfg), cfg, label)
