"""Validate a V4.1 checkpoint directory against the name set its config implies (headers only).

`Checkpoint` has already parsed every header, checked every byte range against its file's size,
checked that each index entry names a shard that holds the tensor, and checked the Engram
tensors. Here the whole tensor set is compared with `tensor_specs(raw)`, in config order:
the first missing tensor, then the first one with the wrong dtype or shape, then the first
left-over one (sorted by name); each is one EngramflowError line. Index and shards must also
agree the other way: a tensor a listed shard holds but the index does not name is refused.
"""
from __future__ import annotations

import json
from collections import Counter
from typing import Any

from engramflow.errors import EngramflowError
from engramflow.io.checkpoint import INDEX, Checkpoint, engram_names
from engramflow.model.v41.config import v41_from_dict
from engramflow.model.v41.names import TensorSpec, tensor_specs


def _expected(spec: TensorSpec) -> str:
    return f"{'/'.join(spec.dtypes)} {list(spec.shape)}"


def _check_index_covers(ckpt: Checkpoint) -> None:
    index = ckpt.root / INDEX
    if not index.is_file():
        return
    weight_map = json.loads(index.read_text())["weight_map"]  # Checkpoint has parsed it already
    if len(weight_map) == len(ckpt.tensors):
        return  # every index entry is held by its shard (Checkpoint), so the sets are equal
    for name, info in sorted(ckpt.tensors.items()):
        if name not in weight_map:
            raise EngramflowError(f"{index}: tensor {name!r} is in shard {info.file.name} but not in the index")


def validate_v41(ckpt: Checkpoint, raw: dict[str, Any]) -> dict[str, Any]:
    """Refuse the first tensor that is missing, wrong or left over; return a compact summary."""
    cfg = v41_from_dict(raw)
    specs = tensor_specs(raw, cfg)
    tensors = ckpt.tensors
    _check_index_covers(ckpt)
    for name, spec in specs.items():
        if name not in tensors:
            raise EngramflowError(f"{name} is missing (expected {_expected(spec)})")
    for name, spec in specs.items():
        info = tensors[name]
        if info.dtype not in spec.dtypes or info.shape != spec.shape:
            raise EngramflowError(f"{name}: expected {_expected(spec)}, found {info.dtype} {list(info.shape)}"
                                  f" (in {info.file.name})")
    if len(tensors) != len(specs):
        extra = sorted(set(tensors) - specs.keys())
        info = tensors[extra[0]]
        raise EngramflowError(f"unexpected tensor {extra[0]!r} (not implied by the config; in {info.file.name},"
                              f" {len(extra)} left over in all)")
    groups = Counter(spec.group.split(".", 1)[0] for spec in specs.values())
    return {
        "model": "deepseek-v4.1",
        "n_layers": cfg.n_layers,
        "tensors": len(tensors),
        "bytes": sum(t.nbytes for t in tensors.values()),
        "files": len({t.file for t in tensors.values()}),
        "groups": dict(groups),
        "engram": _engram_summary(ckpt),
    }


def _engram_summary(ckpt: Checkpoint) -> dict[str, Any]:
    """Checkpoint.summary()["engram"], without building its per-tensor dump (~0.5 s here)."""
    c = ckpt.config
    rows = [ckpt.tensors[engram_names(l)["embed.weight"]].shape[0] for l in c.engram_layer_ids]
    return {"layer_ids": list(c.engram_layer_ids), "rows": rows,
            "layout_ok": all(r >= int(need) for r, need in zip(rows, ckpt.layout.rows_needed))}
