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
import sys
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
_MAX_RANK = 16


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


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


class _Refused(ValueError):
    pass


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set = set()
        for k, _ in pairs:
            if k in seen:
                raise _Refused(f"gives key {k!r} twice")
            seen.add(k)
    return out


def parse_json(raw: bytes, where: str):
    """Outside JSON (a header, an index, a config): UTF-8, valid JSON, no duplicate keys, not
    nested absurdly deep. Any problem is one EngramflowError that starts with `where`. (NaN and
    Infinity literals parse: the checks of each value refuse them, naming the key.)"""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise EngramflowError(f"{where} is not valid UTF-8 (byte {e.start})") from None
    try:
        return json.loads(text, object_pairs_hook=_unique_keys)
    except json.JSONDecodeError as e:
        raise EngramflowError(f"{where} is not valid JSON ({e})") from None
    except _Refused as e:
        raise EngramflowError(f"{where} {e.args[0]}") from None
    except RecursionError:
        raise EngramflowError(f"{where} is nested too deeply (JSON arrays/objects more than "
                              f"{sys.getrecursionlimit()} levels deep)") from None


def read_header(path: Path) -> dict[str, TensorInfo]:
    """Parse and validate one file's header: every value of the right JSON type, every tensor
    inside the file, no two tensors sharing a byte. Errors name the file, tensor and key."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise EngramflowError(f"{path}: {size} bytes is too short for a safetensors header")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8:
                raise EngramflowError(f"{path}: header length {n} runs past the file's {size} bytes (truncated?)")
            if n > _MAX_HEADER:
                raise EngramflowError(f"{path}: header length {n} is above the limit of {_MAX_HEADER} bytes")
            raw = f.read(n)
    except FileNotFoundError:
        raise EngramflowError(f"checkpoint file not found: {path}") from None
    except IsADirectoryError:
        raise EngramflowError(f"{path}: is a directory, not a safetensors file") from None
    doc = parse_json(raw, f"{path}: header")
    if not isinstance(doc, dict):
        raise EngramflowError(f"{path}: header is not a JSON object")
    data_start = 8 + n
    out = {}
    for name, meta in doc.items():
        if name == "__metadata__":
            if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
                raise EngramflowError(f"{path}: '__metadata__' must be an object of strings, got {_short(meta)}")
            continue
        out[name] = _tensor_info(path, name, meta, data_start, size)
    _check_overlaps(path, out.values())
    return out


def _short(v, limit: int = 80) -> str:
    s = repr(v)
    return s if len(s) <= limit else s[:limit] + "..."


def _tensor_info(path: Path, name: str, meta, data_start: int, size: int) -> TensorInfo:
    # the usual well-formed entry passes these few checks (type(x) is int: a bool is not a size)
    try:
        dtype, shape, offsets = meta["dtype"], meta["shape"], meta["data_offsets"]
        ok = (type(dtype) is str and dtype in DTYPES and type(shape) is list and len(shape) <= _MAX_RANK
              and type(offsets) is list and len(offsets) == 2)
    except (TypeError, KeyError):
        ok = False
    if ok:
        for d in shape:
            if type(d) is not int or d < 0:
                ok = False
                break
        begin, end = offsets
        ok = ok and type(begin) is int and type(end) is int and 0 <= begin <= end
    if not ok:
        _refuse_entry(f"{path}: tensor {name!r}", meta)
    nbytes = math.prod(shape) * DTYPES[dtype][0]
    if end - begin != nbytes:
        raise EngramflowError(f"{path}: tensor {name!r}: {dtype}{shape} needs {nbytes} bytes but its offsets span {end - begin}")
    if data_start + end > size:
        raise EngramflowError(f"{path}: tensor {name!r}: ends at byte {data_start + end} but the file has {size} bytes "
                              "(truncated?)")
    return TensorInfo(name, path, dtype, tuple(shape), data_start + begin, nbytes)


def _refuse_entry(where: str, meta) -> None:
    """The header entry failed the quick checks: say which key is wrong and how."""
    if not isinstance(meta, dict):
        raise EngramflowError(f"{where}: header entry must be an object, got {_short(meta)}")
    for key in ("dtype", "shape", "data_offsets"):
        if key not in meta:
            raise EngramflowError(f"{where}: header entry has no {key!r}")
    dtype, shape, offsets = meta["dtype"], meta["shape"], meta["data_offsets"]
    if not isinstance(dtype, str):
        raise EngramflowError(f"{where}: 'dtype' must be a string, got {_short(dtype)}")
    if dtype not in DTYPES:
        raise EngramflowError(f"{where}: unknown dtype {_short(dtype)}")
    if not isinstance(shape, list) or len(shape) > _MAX_RANK or not all(_is_int(d) and d >= 0 for d in shape):
        raise EngramflowError(f"{where}: 'shape' must be a list of at most {_MAX_RANK} integers >= 0, "
                              f"got {_short(shape)}")
    raise EngramflowError(f"{where}: 'data_offsets' must be [begin, end], integers with 0 <= begin <= end, "
                          f"got {_short(offsets)}")


def _check_overlaps(path: Path, infos) -> None:
    """No two tensors may share a byte (a tensor aliasing another reads the other's values)."""
    spans = sorted((t.offset, t.offset + t.nbytes, t.name) for t in infos if t.nbytes)
    for (_, end_a, a), (begin_b, _, b) in zip(spans, spans[1:]):
        if begin_b < end_a:
            raise EngramflowError(f"{path}: tensors {a!r} and {b!r} overlap (bytes {begin_b}..{end_a} of the file "
                                  "belong to both)")


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
    """Write a safetensors file streaming each tensor's chunks; atomic via rename. The bytes go
    to `PATH.partial` first: a failed write (any exception, Ctrl-C included) removes it, and one
    left by a killed run is overwritten by the next."""
    path = Path(path)
    header: dict = {"__metadata__": metadata or {"format": "pt"}}
    pos = 0
    for s in specs:
        header[s.name] = {"dtype": s.dtype, "shape": list(s.shape), "data_offsets": [pos, pos + s.nbytes]}
        pos += s.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # keep the data 8-byte aligned
    if path.is_dir():  # os.replace would fail only after every byte was written
        raise EngramflowError(f"cannot write {path}: it is a folder")
    tmp = path.with_name(path.name + ".partial")
    try:
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
    except BaseException:
        try:
            tmp.unlink()
        except OSError:  # never made, or not a file of ours (e.g. a folder of that name)
            pass
        raise


def iter_chunks(array_fn: Callable[[int, int], np.ndarray], n_rows: int, rows_per_chunk: int) -> Iterator[np.ndarray]:
    """Yield array_fn(start, stop) over row ranges, so a big tensor is never whole in memory."""
    for start in range(0, n_rows, rows_per_chunk):
        yield array_fn(start, min(n_rows, start + rows_per_chunk))
