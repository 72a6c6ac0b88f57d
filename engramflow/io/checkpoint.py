"""A checkpoint directory: `config.json` plus `model.safetensors` or an index and shards.

Three depths of checking, each refusing with one EngramflowError line naming file and tensor:

* at open (always, cheap: headers and small tensors only): config.json and the index parsed as
  checked JSON (types, sizes, nesting), every header entry's types, every tensor's byte range
  inside its file and overlapping no other, the Engram tensors' dtype and shape against the
  config, the table rows against the layout, and the values of the small wkv scales;
* at first use: every tensor copied into memory (`tensor()`: wkv, backbone weights) is scanned
  for NaN encodings on the way (E4M3 codes 0x7F/0xFF, E8M0 0xFF, F32 scales not finite or < 0);
* complete (`verify_values()`, for `inspect`): every byte of the Engram tables, their
  scales and wkv scanned in chunks, with a progress bar. The tables (~190 GB) are not scanned at
  open or on the lookup hot path.

Tensors are read in place through read-only mmaps.
"""
from __future__ import annotations

import mmap
from pathlib import Path, PurePosixPath

import numpy as np

from engramflow.errors import EngramflowError
from engramflow.io.layout import EngramLayout, build_layout
from engramflow.io import config as config_mod
from engramflow.io.safetensors import DTYPES, TensorInfo, read_header

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
TOKEN_MAP = "engram_token_map.bin"

_TORCH_VIEW = {"BF16": "bfloat16", "F8_E4M3": "float8_e4m3fn"}  # torch dtype names (torch imported on use)
OPEN_SCAN_BYTES = 16 << 20  # at open, values of Engram scale tensors up to this size are checked


def engram_names(layer_id: int) -> dict[str, str]:
    p = f"layers.{layer_id}.engram"
    return {k: f"{p}.{k}" for k in ("embed.weight", "embed.scale", "wkv.weight", "wkv.scale", "q_weight", "k_weight")}


MAX_INDEX_BYTES = 256 << 20  # the released index (~96,000 names) is ~10 MB
_SCAN_CHUNK = 64 << 20


def value_kind(info: TensorInfo) -> str | None:
    """Which NaN encodings a tensor's bytes can hold: E4M3 codes (0x7F/0xFF), E8M0 scales
    (0xFF; a `.scale` stored as U8 holds E8M0 bits) or F32 scales (must be finite and >= 0; a
    zero scale, like E8M0 byte 0 = 2^-127, is a legal all-zero block)."""
    if info.dtype == "F8_E4M3":
        return "E4M3"
    if info.dtype == "F8_E8M0" or (info.dtype == "U8" and info.name.endswith(".scale")):
        return "E8M0"
    if info.dtype == "F32" and info.name.endswith(".scale"):
        return "F32 scale"
    return None


def _first_bad(flat: np.ndarray, kind: str, buf: np.ndarray | None = None) -> int:
    """Index of the first NaN encoding in a 1-D chunk of raw values, or -1 (a max first: fast).
    `buf`: scratch u8 space at least the chunk's size (E4M3)."""
    if flat.size == 0:
        return -1
    if kind == "E8M0":
        return int(np.argmax(flat == 0xFF)) if int(flat.max()) == 0xFF else -1
    if kind == "E4M3":
        # 0xFF exactly where the low 7 bits are all ones: the NaN codes 0x7F and 0xFF
        high = np.bitwise_or(flat, np.uint8(0x80), out=None if buf is None else buf[:flat.size])
        return int(np.argmax(high == 0xFF)) if int(high.max()) == 0xFF else -1
    bad = ~np.isfinite(flat) | (flat < 0)
    return int(np.argmax(bad)) if bad.any() else -1


def _describe(kind: str, value) -> str:
    if kind == "E8M0":
        return "E8M0 scale 0xFF (NaN)"
    if kind == "E4M3":
        return f"E4M3 code 0x{int(value):02X} (NaN)"
    return f"scale {float(value)!r} (scales must be finite and >= 0)"


def check_values(info: TensorInfo, array: np.ndarray, progress=None) -> None:
    """Refuse the first NaN encoding in `array` (the tensor's raw values, any shape), scanning it
    in chunks; `progress(n_values)` after each chunk. EngramflowError names the tensor, the
    element index and the value."""
    kind = value_kind(info)
    if kind is None:
        return
    flat = array.reshape(-1)
    step = max(1, _SCAN_CHUNK // flat.itemsize)
    buf = np.empty(min(step, flat.size), np.uint8) if kind == "E4M3" else None
    for start in range(0, flat.size, step):
        chunk = flat[start: start + step]
        i = _first_bad(chunk, kind, buf)
        if i >= 0:
            where = [int(x) for x in np.unravel_index(start + i, info.shape)] if info.shape else []
            raise EngramflowError(f"{info.file.name}: tensor {info.name!r} holds {_describe(kind, chunk[i])} "
                                  f"at {where}: a broken checkpoint")
        if progress:
            progress(chunk.size * chunk.itemsize)


def _read_index(index: Path) -> dict[str, str]:
    """The index's weight_map, every value checked: tensor name -> a shard file inside the directory."""
    doc = config_mod.read_json_file(index, "safetensors index", MAX_INDEX_BYTES)
    if not isinstance(doc, dict) or "weight_map" not in doc:
        raise EngramflowError(f"{index}: not a safetensors index (no 'weight_map' object)")
    weight_map = doc["weight_map"]
    if not isinstance(weight_map, dict):
        raise EngramflowError(f"{index}: 'weight_map' must be an object (tensor name -> shard file), "
                              f"got {type(weight_map).__name__}")
    if not weight_map:
        raise EngramflowError(f"{index}: 'weight_map' is empty")
    checked: set[str] = set()  # ~96,000 names share ~50 shards: each file name is checked once
    for name, fname in weight_map.items():
        if isinstance(fname, str) and fname in checked:
            continue
        if not isinstance(fname, str):
            raise EngramflowError(f"{index}: weight_map[{name!r}] must be a shard file name, "
                                  f"got {type(fname).__name__} {config_mod._short(fname)}")
        p = PurePosixPath(fname)
        if not fname or "\\" in fname or "\0" in fname or p.is_absolute() or ".." in p.parts or fname.endswith("/"):
            raise EngramflowError(f"{index}: weight_map[{name!r}] = {fname!r} is not a file in the checkpoint directory")
        checked.add(fname)
    if "metadata" in doc and not isinstance(doc["metadata"], dict):
        raise EngramflowError(f"{index}: 'metadata' must be an object, got {type(doc['metadata']).__name__}")
    return weight_map


class Checkpoint:
    def __init__(self, root: str | Path):
        self.root = Path(root)
        if not self.root.is_dir():
            raise EngramflowError(f"checkpoint directory not found: {self.root}")
        self.raw_config = config_mod.load_raw(self.root)  # config.json, checked JSON
        self.config = config_mod.from_dict(self.raw_config)
        self.layout: EngramLayout = build_layout(self.config)
        self.tensors: dict[str, TensorInfo] = self._read_headers()
        self._maps: dict[Path, mmap.mmap] = {}
        self.touched: dict[str, int] = {}  # tensors whose bytes were read or viewed -> their size
        self._check_engram()

    # -- discovery and validation ------------------------------------------------------------
    def _read_headers(self) -> dict[str, TensorInfo]:
        index = self.root / INDEX
        if index.is_file():
            weight_map = _read_index(index)
            files = sorted(set(weight_map.values()))
        elif (self.root / SINGLE).is_file():
            weight_map, files = None, [SINGLE]
        else:
            raise EngramflowError(f"{self.root}: neither {INDEX} nor {SINGLE} found")
        tensors: dict[str, TensorInfo] = {}
        shard_of: dict[str, str] = {}  # tensor name -> the file name it was read from
        for fname in files:
            path = self.root / fname
            if not path.is_file():
                raise EngramflowError(f"{index}: shard {fname} is listed but missing from {self.root}")
            for name, info in read_header(path).items():
                if name in tensors:
                    raise EngramflowError(f"tensor {name!r} appears in both {tensors[name].file.name} and {fname}")
                tensors[name] = info
                shard_of[name] = fname
        if weight_map is not None:
            for name, fname in weight_map.items():
                if shard_of.get(name) != fname:
                    raise EngramflowError(f"{index}: tensor {name!r} is mapped to {fname} but that shard does not hold it")
        return tensors

    def _expect(self, name: str, dtypes: tuple[str, ...], shape: tuple[int, ...] | None) -> TensorInfo:
        info = self.tensors.get(name)
        if info is None:
            raise EngramflowError(f"{self.root}: Engram tensor {name!r} is missing")
        if info.dtype not in dtypes:
            raise EngramflowError(f"{info.file.name}: tensor {name!r} has dtype {info.dtype}, expected {' or '.join(dtypes)}")
        if shape is not None and info.shape != shape:
            raise EngramflowError(f"{info.file.name}: tensor {name!r} has shape {list(info.shape)}, expected {list(shape)}")
        return info

    def _check_engram(self) -> None:
        c = self.config
        for layer, rows in zip(c.engram_layer_ids, c.engram_num_embeddings):
            n = engram_names(layer)
            self._expect(n["embed.weight"], ("F8_E4M3",), (rows, c.engram_head_dim))
            self._expect(n["embed.scale"], ("F8_E8M0", "U8"), (rows, c.engram_head_dim // 32))
            self.layout.check_rows(layer, rows, f"{self.root}: tensor {n['embed.weight']!r}")
            w = self._expect(n["wkv.weight"], ("F8_E4M3", "BF16"), (c.engram_output_dim, c.engram_input_dim))
            if w.dtype == "F8_E4M3":
                s = self._expect(n["wkv.scale"], ("F8_E8M0", "U8", "F32"), None)
                if len(s.shape) != 2 or 0 in s.shape or w.shape[0] % s.shape[0] or w.shape[1] % s.shape[1]:
                    raise EngramflowError(
                        f"{s.file.name}: tensor {n['wkv.scale']!r} shape {list(s.shape)} does not tile wkv {list(w.shape)}")
                if s.nbytes <= OPEN_SCAN_BYTES:  # small (150 KB in V4.1): its values are checked now,
                    # read from the file (a validation read: not mapped, not counted in `touched`)
                    check_values(s, np.fromfile(s.file, DTYPES[s.dtype][1], s.numel, offset=s.offset))
            for key in ("q_weight", "k_weight"):
                if n[key] in self.tensors:
                    self._expect(n[key], ("BF16", "F32", "F16"), (c.hc_mult, c.dim))

    # -- reading -----------------------------------------------------------------------------
    def _map(self, path: Path) -> mmap.mmap:
        if path not in self._maps:
            with open(path, "rb") as f:
                self._maps[path] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        return self._maps[path]

    def array(self, name: str) -> np.ndarray:
        """A read-only numpy view of the tensor's raw bytes, mapped in place (no copy)."""
        info = self.info(name)
        dt = np.dtype(DTYPES[info.dtype][1])
        self.touched[name] = info.nbytes
        return np.frombuffer(self._map(info.file), dtype=dt, count=info.numel, offset=info.offset).reshape(info.shape)

    def tensor(self, name: str) -> "torch.Tensor":
        """The tensor as torch (a private copy, so callers may move or modify it). Its values are
        checked on the way (first use): no NaN encodings (`value_kind`)."""
        import torch  # here, not at the top: the history actor reads no tensor and so never pays its import
        info = self.info(name)
        arr = self.array(name).copy()
        check_values(info, arr)
        t = torch.from_numpy(arr)
        return t.view(getattr(torch, _TORCH_VIEW[info.dtype])) if info.dtype in _TORCH_VIEW else t

    def check_values(self, name: str, progress=None) -> None:
        """Scan one tensor's bytes in place for NaN encodings (see `value_kind`)."""
        check_values(self.info(name), self.array(name), progress)

    def engram_value_tensors(self) -> list[str]:
        """The Engram tensors whose values can hold NaN encodings: tables, scales, wkv."""
        names = []
        for layer in self.config.engram_layer_ids:
            n = engram_names(layer)
            names += [n[k] for k in ("embed.weight", "embed.scale", "wkv.weight", "wkv.scale")
                      if n[k] in self.tensors and value_kind(self.tensors[n[k]])]
        return names

    def verify_values(self, names: list[str] | None = None, progress: bool = True) -> dict:
        """The complete value check (for `inspect`): every byte of the Engram tables, their scales
        and wkv (or of `names`) scanned in chunks for NaN encodings, with a progress bar on a
        terminal. Returns {"tensors", "bytes"} scanned; the first bad value is an EngramflowError."""
        from tqdm import tqdm

        names = self.engram_value_tensors() if names is None else names
        total = sum(self.info(n).nbytes for n in names)
        with tqdm(total=total, unit="B", unit_scale=True, desc="checking Engram values",
                  disable=None if progress and total >= _SCAN_CHUNK else True) as bar:
            for n in names:
                self.check_values(n, bar.update)
        return {"tensors": len(names), "bytes": total}

    def info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise EngramflowError(f"{self.root}: no tensor named {name!r}") from None

    def advise(self, name: str, advice: int) -> None:
        """madvise the tensor's byte range (page-aligned outward)."""
        info = self.info(name)
        page = mmap.PAGESIZE
        start = info.offset // page * page
        self._map(info.file).madvise(advice, start, info.offset + info.nbytes - start)

    def close(self) -> None:
        for m in self._maps.values():
            try:
                m.close()
            except BufferError:
                pass  # arrays still view it; the mapping goes when they do
        self._maps.clear()

    def summary(self) -> dict:
        c = self.config
        rows = [self.tensors[engram_names(l)["embed.weight"]].shape[0] for l in c.engram_layer_ids]
        return {
            "tensors": {n: {"dtype": t.dtype, "shape": list(t.shape), "file": t.file.name}
                        for n, t in sorted(self.tensors.items())},
            "engram": {"layer_ids": list(c.engram_layer_ids), "rows": rows,
                       "layout_ok": all(r >= int(need) for r, need in zip(rows, self.layout.rows_needed))},
        }

    def token_map_path(self) -> Path | None:
        p = self.root / TOKEN_MAP
        return p if p.is_file() else None
