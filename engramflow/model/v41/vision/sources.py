"""Where an image comes from: bytes, a file path, a PIL image, or a URL (chat API parts).

`load_image_from_data_url` is the entry the server calls for an OpenAI `image_url` part: `data:`
URLs (base64) are decoded; remote `http(s)` URLs are refused unless the operator allowed them
(fetching whatever URL a client names is a server-side request forgery hole).
"""
from __future__ import annotations

import base64
import binascii
import os
import time
from pathlib import Path

from engramflow.model.v41.vision.config import VisionConfig
from engramflow.model.v41.vision.errors import ImageError
from engramflow.model.v41.vision.preprocess import PreparedImage, check_header, prepare_image, prepare_rgb

MAX_FETCH_BYTES = 64 << 20
FETCH_CHUNK = 1 << 16


def load_image_from_data_url(url: str, allow_remote: bool = False, timeout_s: float = 10.0) -> bytes:
    """The image bytes a `data:` URL carries (or, only with allow_remote, an http(s) URL's body)."""
    if not isinstance(url, str) or not url:
        raise ImageError("bad_source", f"image URL must be a non-empty string, got {type(url).__name__}")
    if url.startswith("data:"):
        header, sep, payload = url.partition(",")
        if not sep or ";base64" not in header:
            raise ImageError("bad_source", f"data URL {header[:40]!r}... must be base64 (data:<type>;base64,<data>)")
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as e:
            raise ImageError("bad_source", f"data URL payload is not valid base64: {e}") from None
    if url.startswith(("http://", "https://")):
        if not allow_remote:
            raise ImageError("remote_refused", f"remote image URL {url[:60]!r} refused: only data: URLs are accepted "
                                               f"unless the operator allows remote images")
        return _fetch(url, timeout_s)
    raise ImageError("bad_source", f"image URL scheme of {url[:40]!r} is not supported (data: or, if allowed, http(s))")


def _fetch(url: str, timeout_s: float) -> bytes:
    """The body of `url`, within about `timeout_s` in all: urlopen's timeout bounds each read
    only, so a server dripping a byte at a time would otherwise hold the fetching worker (and
    the request) for as long as it likes."""
    from urllib.request import urlopen

    deadline = time.monotonic() + timeout_s
    chunks, size = [], 0
    try:
        with urlopen(url, timeout=timeout_s) as response:  # noqa: S310 (the operator allowed it)
            while size <= MAX_FETCH_BYTES:
                if time.monotonic() > deadline:
                    raise TimeoutError
                chunk = response.read1(FETCH_CHUNK)  # what has arrived so far, at most one read's wait
                if not chunk:
                    break
                chunks.append(chunk)
                size += len(chunk)
    except TimeoutError:  # past the deadline, or one read waited timeout_s: the same verdict
        raise ImageError("bad_source", f"image {url[:60]!r} did not arrive within {timeout_s:g} s") from None
    except OSError as e:
        raise ImageError("bad_source", f"cannot fetch image {url[:60]!r}: {e}") from None
    if size > MAX_FETCH_BYTES:
        raise ImageError("too_many_pixels", f"image {url[:60]!r} is larger than {MAX_FETCH_BYTES} bytes")
    return b"".join(chunks)


def prepare_any(image, cfg: VisionConfig, label: str = "") -> PreparedImage:
    """bytes / bytearray, a path (str or os.PathLike), or a PIL image -> PreparedImage."""
    if isinstance(image, PreparedImage):
        return image
    if isinstance(image, (bytes, bytearray, memoryview)):
        return prepare_image(bytes(image), cfg, label)
    if isinstance(image, (str, os.PathLike)):
        path = Path(image)
        if str(image).startswith(("data:", "http://", "https://")):
            return prepare_image(load_image_from_data_url(str(image)), cfg, label or str(image)[:40])
        try:
            data = path.read_bytes()
        except OSError as e:
            raise ImageError("bad_source", f"cannot read image file {str(path)!r}: {e.strerror or e}") from None
        return prepare_image(data, cfg, label or str(path))
    try:
        from PIL import Image
    except ImportError:  # pragma: no cover - Pillow is a dependency
        Image = None
    if Image is not None and isinstance(image, Image.Image):
        return _prepare_pil(image, cfg, label or f"<PIL {image.mode} {image.width}x{image.height}>")
    raise ImageError("bad_source", f"an image must be bytes, a path or a PIL image, got {type(image).__name__}")


def _prepare_pil(img, cfg: VisionConfig, label: str) -> PreparedImage:
    """An already decoded image: the same checks and steps, minus the file format."""
    check_header(None, img.size, label, cfg)
    return prepare_rgb(img.convert("RGB"), cfg, label)
