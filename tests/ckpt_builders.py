"""Helpers that write small, deliberately broken or oversized checkpoints for tests."""
import json
import struct
from pathlib import Path

import numpy as np

from engramflow.io.checkpoint import engram_names
from engramflow.io.safetensors import DTYPES, TensorSpec, write_file


def array_spec(name, dtype, array):
    array = np.ascontiguousarray(array)
    return TensorSpec(name, dtype, tuple(array.shape), lambda: [array])


def engram_arrays(cfg, rows=None, rng=None):
    """{name: (dtype, array)} for every Engram tensor of `cfg` (small random values)."""
    rng = rng or np.random.default_rng(0)
    out = {}
    for layer, n_rows in zip(cfg.engram_layer_ids, rows or cfg.engram_num_embeddings):
        n = engram_names(layer)
        d, cin, cout = cfg.engram_head_dim, cfg.engram_input_dim, cfg.engram_output_dim
        out[n["embed.weight"]] = ("F8_E4M3", rng.integers(0, 0x7F, (n_rows, d), dtype=np.uint8))
        out[n["embed.scale"]] = ("F8_E8M0", rng.integers(120, 130, (n_rows, d // 32), dtype=np.uint8))
        out[n["wkv.weight"]] = ("F8_E4M3", rng.integers(0, 0x7F, (cout, cin), dtype=np.uint8))
        out[n["wkv.scale"]] = ("F8_E8M0", rng.integers(118, 120, (cout // 32, cin // 32), dtype=np.uint8))
    return out


def write_single(root: Path, cfg_dict: dict, arrays: dict) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(cfg_dict))
    write_file(root / "model.safetensors", [array_spec(k, dt, a) for k, (dt, a) in arrays.items()])
    return root


def write_sparse(path: Path, tensors: dict[str, tuple[str, tuple[int, ...]]]) -> None:
    """A valid safetensors file whose data is a hole: zero bytes on disk, zeros when read."""
    header, pos = {}, 0
    for name, (dtype, shape) in tensors.items():
        nbytes = int(np.prod(shape)) * DTYPES[dtype][0]
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [pos, pos + nbytes]}
        pos += nbytes
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + pos)
