"""Synthetic checkpoints with the official names, dtypes and sharding (docs/v41.md).

Deterministic from the seed: every tensor draws from its own generator seeded by
(seed, crc32(name)), chunk by chunk, so a multi-GiB table is streamed to disk and never sits
in RAM. Presets:

* `tiny`: the real V4 vocabulary and real Engram hashing (layers [1, 14], 4-grams, 8 heads),
  small dims and tables, plus reference-backbone weights; small enough for CI.
* `v41-small`: a small V4.1 model in exactly the released format (model/v41/synth.py): every
  layer role, Engram at two layers, the real V4 vocabulary; what `make demo` runs.
* `v41-engram`: the real Engram geometry (head_dim 256, dim 5,120, hc 4, wkv 25,600 × 6,144,
  40 blocks), table rows scaled by `engram_vocab_size`; no backbone (pairs with `emulated`).
"""
from __future__ import annotations

import json
import shutil
import zlib
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from engramflow.errors import EngramflowError, check_seed
from engramflow.io.atomic import atomic_write, missing_dirs, remove_made_dirs
from engramflow.io.token_map import TokenMap
from engramflow.io.tokenizer_file import TOKENIZER_FILE, v41_tokenizer_json
from engramflow.io.checkpoint import INDEX, TOKEN_MAP, engram_names
from engramflow.io.config import ModelConfig, from_dict
from engramflow.io.presets import SYNTHETIC, preset_raw
from engramflow.io.safetensors import TensorSpec, iter_chunks, write_file
from engramflow.model.v41.synth import v41_backbone_specs

_CHUNK_BYTES = 16 << 20

# shard size per preset: small for tiny so its index really spans several files
_SHARD_BYTES = {"tiny": 8 << 20, "v41-engram": 2 << 30, "v41-small": 32 << 20}


def synth_config(preset: str, engram_vocab_size: int | None = None) -> ModelConfig:
    if preset not in SYNTHETIC:
        raise EngramflowError(f"unknown checkpoint preset {preset!r}; known: {', '.join(SYNTHETIC)}")
    return from_dict(preset_raw(preset, engram_vocab_size))


def _rng(seed: int, name: str) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(name.encode())])


def _fp8_codes(rng: np.random.Generator, n: int) -> np.ndarray:
    """E4M3 codes with exponent field 4..11 (values ~2^-3..2^4), random sign and mantissa."""
    b = rng.integers(0, 256, n, dtype=np.uint8)
    return (b & 0x87) | (((b >> 3) & 0x7) + 4) << 3


def _u8_spec(name: str, dtype: str, shape: tuple[int, ...], seed: int, fill) -> TensorSpec:
    """A 1-byte tensor generated row-chunk by row-chunk from `fill(rng, n_values)`."""
    row = int(np.prod(shape[1:]))
    rows_per_chunk = max(1, _CHUNK_BYTES // row)

    def chunks():
        rng = _rng(seed, name)
        return iter_chunks(lambda a, b: fill(rng, (b - a) * row), shape[0], rows_per_chunk)

    return TensorSpec(name, dtype, shape, chunks)


def _scales(lo: int, hi: int):
    def fill(rng, n):
        return rng.integers(lo, hi + 1, n, dtype=np.uint8)
    return fill


def _bf16_spec(name: str, tensor: torch.Tensor) -> TensorSpec:
    data = tensor.to(torch.bfloat16).contiguous().view(torch.int16).numpy()
    return TensorSpec(name, "BF16", tuple(tensor.shape), lambda: [data])


def engram_specs(cfg: ModelConfig, seed: int, wkv_block: int, gate_weights: bool) -> list[TensorSpec]:
    specs = []
    for layer, rows in zip(cfg.engram_layer_ids, cfg.engram_num_embeddings):
        n = engram_names(layer)
        out_dim, in_dim = cfg.engram_output_dim, cfg.engram_input_dim
        specs += [
            _u8_spec(n["embed.weight"], "F8_E4M3", (rows, cfg.engram_head_dim), seed, _fp8_codes),
            _u8_spec(n["embed.scale"], "F8_E8M0", (rows, cfg.engram_head_dim // 32), seed, _scales(122, 127)),
            _u8_spec(n["wkv.weight"], "F8_E4M3", (out_dim, in_dim), seed, _fp8_codes),
            # |w| ~ 2^-8 keeps |x @ W^T| ~ 1 for x ~ 1 over thousands of inputs
            _u8_spec(n["wkv.scale"], "F8_E8M0", (out_dim // wkv_block, in_dim // wkv_block), seed, _scales(117, 119)),
        ]
        if gate_weights:
            for key in ("q_weight", "k_weight"):
                g = torch.Generator().manual_seed(seed * 1000 + zlib.crc32(n[key].encode()) % 1000)
                specs.append(_bf16_spec(n[key], 1 + 0.1 * torch.randn(cfg.hc_mult, cfg.dim, generator=g)))
    return specs


def _shard(specs: list[TensorSpec], max_bytes: int) -> list[list[TensorSpec]]:
    shards, size = [[]], 0
    for s in specs:
        if shards[-1] and size + s.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(s)
        size += s.nbytes
    return shards


def _check_room(out: Path, files: dict[str, int]) -> None:
    """Refuse at once when the disk cannot hold the files (name -> bytes): a file replaced by
    rename needs its new bytes before the old ones go, the largest one at a time."""
    present = sum((out / n).stat().st_size for n in files if (out / n).is_file())
    need = sum(files.values()) - present + max(files.values())
    where = next(d for d in [out, *out.parents] if d.exists())
    free = shutil.disk_usage(where).free
    if need > free:
        raise EngramflowError(f"the checkpoint needs {need / 1e9:.2f} GB more on disk but {where} has "
                              f"{free / 1e9:.2f} GB free")


def make_checkpoint(preset: str, out: str | Path, engram_vocab_size: int | None = None, seed: int = 0,
                    progress: bool = True) -> Path:
    """Write the preset's checkpoint into `out`. Every argument and every destination is checked
    before the first byte is written; if writing fails anyway (a full disk, Ctrl-C), the files and
    folders this run created are removed. Files that were there before are replaced, never removed."""
    check_seed(seed)
    cfg = synth_config(preset, engram_vocab_size)
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise EngramflowError(f"cannot write a checkpoint into {out}: it is not a folder")
    if preset == "tiny":
        from engramflow.model.backbone_reference import reference_weights

        backbone = reference_weights(cfg, seed)
        specs = engram_specs(cfg, seed, wkv_block=32, gate_weights=not any(k.endswith("q_weight") for k in backbone))
        specs += [_bf16_spec(k, v) for k, v in backbone.items()]
    elif preset == "v41-small":
        raw = preset_raw(preset, engram_vocab_size)
        specs = engram_specs(cfg, seed, wkv_block=32, gate_weights=True) + v41_backbone_specs(raw, seed)
    else:
        specs = engram_specs(cfg, seed, wkv_block=128, gate_weights=True)
    shards = _shard(specs, _SHARD_BYTES[preset])
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    token_map = TokenMap.default()  # may build the map (seconds): before anything is written
    files = {n: sum(s.nbytes for s in shard) for n, shard in zip(names, shards)}
    tokenizer = v41_tokenizer_json()  # V4.1's special tokens as single ids
    files |= {INDEX: 1 << 20, "config.json": 1 << 16, TOKEN_MAP: token_map.table.nbytes,
              TOKENIZER_FILE: len(tokenizer.encode())}
    for name in files:
        for p in (out / name, out / f"{name}.partial", out / f"{name}.tmp"):
            if p.is_dir():
                raise EngramflowError(f"cannot write {out / name}: {p} is a folder")
    _check_room(out, files)
    made = missing_dirs(out)
    new = [out / n for n in files if not (out / n).exists()]  # what a failed run removes again
    try:
        out.mkdir(parents=True, exist_ok=True)
        weight_map = {}
        total = sum(s.nbytes for s in specs)
        with tqdm(total=total, unit="B", unit_scale=True, disable=not progress,
                  desc=f"writing {preset} checkpoint") as bar:
            for fname, shard in zip(names, shards):
                write_file(out / fname, shard, progress=bar.update)
                weight_map |= {s.name: fname for s in shard}
        atomic_write(out / INDEX, json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
        raw = preset_raw(preset, engram_vocab_size) if preset == "v41-small" else cfg.to_dict()
        atomic_write(out / "config.json", json.dumps(raw | {"engramflow_preset": preset, "seed": seed}, indent=1))
        token_map.save(out / TOKEN_MAP)
        atomic_write(out / TOKENIZER_FILE, tokenizer)
    except BaseException:
        for p in new:
            try:
                p.unlink()
            except OSError:
                pass
        remove_made_dirs(made)
        raise
    return out
