"""A checkpoint directory: `config.json` plus `model.safetensors` or an index and shards.

Opening validates everything before the first lookup: every header, every tensor's byte range
against its file's size, the Engram tensors' dtype and shape against the config, and the table
rows against the layout. Tensors are then read in place through read-only mmaps.
"""
from __future__ import annotations

import json
import mmap
from pathlib import Path

import numpy as np
import torch

from engramflow.errors import EngramflowError
from engramflow.io.layout import EngramLayout, build_layout
from engramflow.io import config as config_mod
from engramflow.io.safetensors import DTYPES, TensorInfo, read_header

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
TOKEN_MAP = "engram_token_map.bin"

_TORCH_VIEW = {"BF16": torch.bfloat16, "F8_E4M3": torch.float8_e4m3fn}


def engram_names(layer_id: int) -> dict[str, str]:
    p = f"layers.{layer_id}.engram"
    return {k: f"{p}.{k}" for k in ("embed.weight", "embed.scale", "wkv.weight", "wkv.scale", "q_weight", "k_weight")}


class Checkpoint:
    def __init__(self, root: str | Path):
        self.root = Path(root)
        if not self.root.is_dir():
            raise EngramflowError(f"checkpoint directory not found: {self.root}")
        self.config = config_mod.load(self.root)
        self.layout: EngramLayout = build_layout(self.config)
        self.tensors: dict[str, TensorInfo] = self._read_headers()
        self._maps: dict[Path, mmap.mmap] = {}
        self.touched: dict[str, int] = {}  # tensors whose bytes were read or viewed -> their size
        self._check_engram()

    # -- discovery and validation ------------------------------------------------------------
    def _read_headers(self) -> dict[str, TensorInfo]:
        index = self.root / INDEX
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                assert isinstance(weight_map, dict)
            except (json.JSONDecodeError, KeyError, TypeError, AssertionError):
                raise EngramflowError(f"{index}: not a safetensors index (no 'weight_map' object)") from None
            files = sorted(set(weight_map.values()))
        elif (self.root / SINGLE).is_file():
            weight_map, files = None, [SINGLE]
        else:
            raise EngramflowError(f"{self.root}: neither {INDEX} nor {SINGLE} found")
        tensors: dict[str, TensorInfo] = {}
        for fname in files:
            path = self.root / fname
            if not path.is_file():
                raise EngramflowError(f"{index}: shard {fname} is listed but missing from {self.root}")
            for name, info in read_header(path).items():
                if name in tensors:
                    raise EngramflowError(f"tensor {name!r} appears in both {tensors[name].file.name} and {fname}")
                tensors[name] = info
        if weight_map is not None:
            for name, fname in weight_map.items():
                if name not in tensors or tensors[name].file.name != fname:
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

    def tensor(self, name: str) -> torch.Tensor:
        """The tensor as torch (a private copy, so callers may move or modify it)."""
        info = self.info(name)
        t = torch.from_numpy(self.array(name).copy())
        return t.view(_TORCH_VIEW[info.dtype]) if info.dtype in _TORCH_VIEW else t

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
