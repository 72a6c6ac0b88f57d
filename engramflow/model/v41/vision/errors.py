"""One error type for a bad image, with a short machine-readable kind (a server maps any of them
to HTTP 400, the CLI to exit status 2) and a message naming the image and the problem."""
from __future__ import annotations

from engramflow.errors import EngramflowError

KINDS = ("not_an_image", "unsupported_format", "truncated", "corrupt", "too_many_pixels", "zero_size",
         "aspect_ratio", "too_many_tokens", "bad_source", "remote_refused", "placeholder_count")


class ImageError(EngramflowError):
    def __init__(self, kind: str, message: str):
        assert kind in KINDS, kind
        super().__init__(message)
        self.kind = kind
