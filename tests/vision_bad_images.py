"""One example of each kind of bad image, made here (bytes), with the ImageError kind it must raise."""
import io
import struct
import zlib

from PIL import Image

from v41_vision_golden import IMAGES


def png_header(width: int, height: int) -> bytes:
    """A PNG that declares this size and holds (almost) no pixel data: it must be refused from
    its header alone, before any decoding."""
    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 10)) + chunk(b"IEND", b"")


def encoded(img: Image.Image, fmt: str) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt)
    return buf.getvalue()


def bad_images() -> dict[str, tuple[bytes, str]]:
    good = (IMAGES / "rgb_small.png").read_bytes()
    return {
        "truncated": (good[: len(good) // 2], "truncated"),
        "corrupt": (good[:60] + bytes(200) + good[260:], "corrupt"),
        "not an image": (b"hello world, this is text", "not_an_image"),
        "empty": (b"", "not_an_image"),
        "unsupported (ICO)": (encoded(Image.new("RGB", (16, 16)), "ICO"), "unsupported_format"),
        "bomb above our limit": (png_header(9000, 8000), "too_many_pixels"),
        "bomb above Pillow's": (png_header(100_000, 100_000), "too_many_pixels"),
        "zero size": (png_header(0, 10), "zero_size"),
        "absurd aspect": (encoded(Image.new("RGB", (1, 500)), "PNG"), "aspect_ratio"),
    }
