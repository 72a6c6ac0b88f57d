"""What one request may ask of a replica, checked before any work is done on it.

Each check is cheap (counting, a header, a length) and runs before the step it guards: the body
size before the body is read, message and image counts before the prompt is written, each
image's declared size before its pixels are decoded, and a lower bound on the prompt's tokens
before it is tokenized: a token never covers more characters than the vocabulary's longest
token has, so a text of C characters is at least C / that many tokens.
"""
from __future__ import annotations

import dataclasses
import io

from engramflow.serve.errors import bad


@dataclasses.dataclass(frozen=True)
class Limits:
    max_body_bytes: int = 32 << 20  # a 413 past it (images come as base64 data URLs)
    max_messages: int = 2048
    max_images: int = 16  # image parts per request
    max_image_pixels: int = 4096 * 4096  # per image, from its header (the model resizes to <= its token budget)


def check_counts(body: dict, limits: Limits, n_images: int) -> None:
    messages = body.get("messages")
    if isinstance(messages, list) and len(messages) > limits.max_messages:
        raise bad(f"messages holds {len(messages)} messages; this server takes at most {limits.max_messages}",
                  "messages", "too_many_messages")
    if n_images > limits.max_images:
        raise bad(f"the request has {n_images} images; this server takes at most {limits.max_images} per request",
                  "messages", "too_many_images")


def max_token_chars(tokenizer) -> int:
    """The most characters one token of this vocabulary covers (byte-level: bytes, so at least
    the characters; added tokens included)."""
    return max((len(t) for t in tokenizer.get_vocab(with_added_tokens=True)), default=1)


def check_text_fits(chars: int, per_token: int, max_seq_len: int, param: str) -> None:
    """Refuse, before tokenizing, a text that cannot fit the model whatever its tokens are."""
    if chars > max_seq_len * per_token:
        raise bad(f"the prompt has {chars} characters: at least {-(-chars // per_token)} tokens, and this "
                  f"model's length is {max_seq_len}", param, "context_length_exceeded")


def declared_size(data: bytes) -> tuple[int, int] | None:
    """An image's (width, height) from its header, nothing decoded; None when Pillow cannot read
    the header (the image preprocessing then names the problem)."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as img:
            return img.size
    except Exception:  # noqa: BLE001 - any unreadable header is the preprocessing's to name
        return None


def check_image_size(k: int, size: tuple[int, int] | None, limits: Limits) -> None:
    if size is not None and size[0] * size[1] > limits.max_image_pixels:
        w, h = size
        raise bad(f"image {k + 1}: {w}x{h} = {w * h} pixels is above this server's limit of "
                  f"{limits.max_image_pixels} per image (checked before decoding)", "messages", "too_many_pixels")
