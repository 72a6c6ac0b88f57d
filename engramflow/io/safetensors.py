"""safetensors files without the library: parse and validate headers, write in a stream.

Format: u64 little-endian header length N, N bytes of JSON {name: {dtype, shape,
data_offsets: [begin, end]}, "__metadata__": {...}}, then the data; offsets are relative to
the end of the header. We parse it ourselves so that every byte range is checked against the
file size *before* anything is mapped (a truncated shard is an error, never a SIGBUS), and
so that multi-GiB tensors can be written chunk by chunk.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import struct
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np

from engramflow.errors import EngramflowError

# safetensors dtype -> (bytes per element, numpy dtype used to view the raw bytes)
DTYPES: dict[str, tuple[int, str]] = {
    "BOOL": (1, "u1"), "U8": (1, "u1"), "I8": (1, "i1"), "F8_E4M3": (1, "u1"), "F8_E5M2": (1, "u1"),
    "F8_E8M0": (1, "u1"), "U16": (2, "<u2"), "I16": (2, "<i2"), "F16": (2, "<f2"), "BF16": (2, "<u2"),
    "U32": (4, "<u4"), "I32": (4, "<i4"), "F32": (4, "<f4"), "U64": (8, "<u8"), "I64": (8, "<i8"),
    "F64": (8, "<f8"),
}
_MAX_HEADER = 256 << 20


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    name: str
    file: Path
    dtype: str
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in the file
    nbytes: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def read_header(path: Path) -> dict[str, TensorInfo]:
    """Parse and validate one file's header; every tensor must lie inside the file."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise EngramflowError(f"{path}: {size} bytes is too short for a safetensors header")
            (n,) = struct.unpack("<Q", head)
            if n > min(size - 8, _MAX_HEADER):
                raise EngramflowError(f"{path}: header length {n} runs past the file's {size} bytes (truncated?)")
            raw = f.read(n)
    except FileNotFoundError:
        raise EngramflowError(f"checkpoint file not found: {path}") from None
    try:
        doc = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise EngramflowError(f"{path}: header is not valid JSON ({e})") from None
    if not isinstance(doc, dict):
        raise EngramflowError(f"{path}: header is not a JSON object")
    data_start = 8 + n
    out = {}
    for name, meta in doc.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = meta["dtype"], tuple(meta["shape"]), meta["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise EngramflowError(f"{path}: tensor {name!r} has a malformed header entry {meta!r}") from None
        if dtype not in DTYPES:
            raise EngramflowError(f"{path}: tensor {name!r} has unknown dtype {dtype!r}")
        if not all(isinstance(d, int) and d >= 0 for d in shape) or not (0 <= begin <= end):
            raise EngramflowError(f"{path}: tensor {name!r} has a bad shape {shape} or offsets {[begin, end]}")
        nbytes = math.prod(shape) * DTYPES[dtype][0]
        if end - begin != nbytes:
            raise EngramflowError(
                f"{path}: tensor {name!r} {dtype}{list(shape)} needs {nbytes} bytes but its offsets span {end - begin}")
        if data_start + end > size:
            raise EngramflowError(
                f"{path}: tensor {name!r} ends at byte {data_start + end} but the file has {size} bytes (truncated?)")
        out[name] = TensorInfo(name, path, dtype, shape, data_start + begin, nbytes)
    return out


@dataclasses.dataclass
class TensorSpec:
    """A tensor to write: its bytes come from `chunks()`, in order, summing to nbytes."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    chunks: Callable[[], Iterable[bytes | np.ndarray]]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPES[self.dtype][0]


def write_file(path: Path, specs: list[TensorSpec], metadata: dict[str, str] | None = None,
               progress: Callable[[int], None] | None = None) -> None:
    """Write a safetensors file streaming each tensor's chunks; atomic via rename."""
    header: dict = {"__metadata__": metadata or {"format": "pt"}}
    pos = 0
    for s in specs:
        header[s.name] = {"dtype": s.dtype, "shape": list(s.shape), "data_offsets": [pos, pos + s.nbytes]}
        pos += s.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # keep the data 8-byte aligned
    tmp = path.with_name(path.name + ".partial")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for s in specs:
            written = 0
            for chunk in s.chunks():
                data = chunk.tobytes() if isinstance(chunk, np.ndarray) else bytes(chunk)
                f.write(data)
                written += len(data)
                if progress:
                    progress(len(data))
            if written != s.nbytes:
                raise RuntimeError(f"tensor {s.name!r}: wrote {written} bytes, expected {s.nbytes}")
    os.replace(tmp, path)


def iter_chunks(array_fn: Callable[[int, int], np.ndarray], n_rows: int, rows_per_chunk: int) -> Iterator[np.ndarray]:
    """Yield array_fn(start, stop) over row ranges, so a big tensor is never whole in memory."""
    for start in range(0, n_rows, rows_per_chunk):
        yield array_fn(start, min(n_rows, start + rows_per_chunk))
