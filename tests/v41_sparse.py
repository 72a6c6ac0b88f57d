"""A full-size V4.1 checkpoint directory in the released format, written in seconds.

Every tensor the released config implies (names.tensor_specs: ~96,000 names, ~510 GB) is laid
out over sharded safetensors files with a `model.safetensors.index.json`. Each shard is a real
safetensors header followed by a sparse payload: the file is created, the header written and the
file truncated up to its full size, so no data bytes are written and it occupies ~0 disk.
Validation reads headers only, so this is all `engramflow inspect` needs.

Helpers to corrupt a copy cheaply: `link_copy` makes a directory of symlinks to the shards
(config and index copied), and `write_shard` / `write_index` rewrite one shard or the index.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import struct
from pathlib import Path

from engramflow.io.safetensors import DTYPES
from engramflow.model.v41.names import tensor_specs

INDEX = "model.safetensors.index.json"

# The released DeepSeek V4.1 config.json (shared/official_v41/config.json), copied as plain data.
RELEASED_CONFIG: dict = {
    "vocab_size": 129280, "dim": 5120, "moe_inter_dim": 2304, "n_layers": 40, "n_mtp_layers": 3,
    "dspark_block_size": 5, "dspark_noise_token_id": 128799, "dspark_target_layer_ids": [37, 38, 39],
    "dspark_markov_rank": 256, "dspark_n_routed_experts": 128, "dspark_n_activated_experts": 3,
    "n_heads": 64, "n_routed_experts": 384, "n_shared_experts": 1, "n_activated_experts": 6,
    "score_func": "sqrtsoftplus", "route_scale": 1.5, "swiglu_limit": 10.0, "q_lora_rank": 1280,
    "head_dim": 512, "rope_head_dim": 64, "norm_eps": 1e-20, "o_groups": 8, "o_lora_rank": 1024,
    "window_size": 128, "kv_source_layers": [2, 8, 14, 20],
    "index_source_layers": [2, 8, 14, 20, 24, 28, 32, 36], "original_seq_len": 65536,
    "rope_theta": 10000, "rope_factor": 16, "beta_fast": 32, "beta_slow": 1, "index_n_heads": 32,
    "index_head_dim": 128, "index_topk": 512, "candidate_source_layer": 20,
    "candidate_topk_blocks": 2048, "candidate_block_size": 8, "hc_mult": 4, "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-06, "engram_layer_ids": [1, 14], "engram_vocab_size": 16000000,
    "engram_num_embeddings": [384006168, 384016682], "engram_max_ngram_size": 4, "engram_pad_id": 2,
    "engram_compressed_vocab_size": 99092, "dtype": "fp8", "expert_dtype": "fp4",
    "compress_rope_theta": 160000,
    "compress_ratios": [0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0],
    "vision_n_layers": 32, "vision_dim": 1024, "vision_n_heads": 16, "vision_inter_dim": 2816,
    "vision_patch_size": 14, "vision_downsample_ratio": 3, "vision_max_n_token": 1024,
    "vision_min_pixels": 295936, "vision_max_wh_ratio": None, "image_token_id": 129264,
    "engram_n_heads": 8, "engram_head_dim": 256, "vision_rope_theta": 10000,
}

Entry = tuple[str, str, tuple[int, ...]]  # name, dtype, shape


def nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    return math.prod(shape) * DTYPES[dtype][0]


def plan_shards(raw: dict, shard_bytes: int) -> list[list[Entry]]:
    """The released name set in config order, each tensor in its first accepted dtype, packed
    greedily into shards of about shard_bytes (a bigger tensor gets a shard of its own)."""
    shards: list[list[Entry]] = [[]]
    size = 0
    for name, spec in tensor_specs(raw).items():
        n = nbytes(spec.dtypes[0], spec.shape)
        if shards[-1] and size + n > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, spec.dtypes[0], spec.shape))
        size += n
    return shards


def shard_name(i: int, n: int) -> str:
    return f"model-{i + 1:05d}-of-{n:05d}.safetensors"


def write_shard(path: Path, entries: list[Entry], cut: int = 0) -> int:
    """A safetensors header for entries, then a sparse payload; `cut` bytes short if asked.
    Replaces whatever is at path (a symlink included: the link goes, its target is untouched)."""
    header: dict = {"__metadata__": {"format": "pt"}}
    pos = 0
    for name, dtype, shape in entries:
        n = nbytes(dtype, shape)
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [pos, pos + n]}
        pos += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    path = Path(path)
    if path.is_symlink() or path.exists():
        path.unlink()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        f.truncate(8 + len(raw) + pos - cut)
    return pos


def write_index(out_dir: Path, weight_map: dict[str, str], total: int) -> None:
    (Path(out_dir) / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))


def write_full_size_v41(out_dir, raw_config: dict | None = None, shard_bytes: int = 6 << 30) -> list[list[Entry]]:
    """Write config.json, the sharded sparse safetensors and the index; returns the shard plan."""
    raw = RELEASED_CONFIG if raw_config is None else raw_config
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(raw, indent=1))
    plan = plan_shards(raw, shard_bytes)
    weight_map, total = {}, 0
    for i, entries in enumerate(plan):
        fname = shard_name(i, len(plan))
        total += write_shard(out / fname, entries)
        weight_map.update((name, fname) for name, _, _ in entries)
    write_index(out, weight_map, total)
    return plan


def link_copy(src: Path, dst: Path) -> Path:
    """dst with config.json and the index copied and every shard a symlink to src's (cheap)."""
    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True)
    for p in src.iterdir():
        if p.name.endswith(".safetensors"):
            os.symlink(p.resolve(), dst / p.name)
        elif p.is_file():
            shutil.copyfile(p, dst / p.name)
    return dst
