"""Model configuration: `config.json` read and merged once, its one table of limits, and the
Engram keys plus backbone geometry every backbone needs (`ModelConfig`).

Accepts HF layout (keys under `text_config`, `hidden_size`, `engram_pad_token_id`) and the
official inference layout (flat keys, `dim`, `engram_pad_id`): `text_keys` merges them, and
`pick` reads a key under any of its spellings. The V4.1 backbone's own view of the same file
(model/v41/config.py) reads through these two and checks against the same LIMITS. The keys
themselves are described in docs/v41.md.
"""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

from engramflow.errors import EngramflowError
from engramflow.io.safetensors import parse_json

# canonical name -> accepted spellings, in order of preference
_ALIASES: dict[str, tuple[str, ...]] = {
    "vocab_size": ("vocab_size",),
    "dim": ("dim", "hidden_size"),
    "n_layers": ("n_layers", "num_hidden_layers"),
    "hc_mult": ("hc_mult",),
    "engram_layer_ids": ("engram_layer_ids",),
    "engram_num_embeddings": ("engram_num_embeddings",),
    "engram_max_ngram_size": ("engram_max_ngram_size",),
    "engram_n_heads": ("engram_n_heads",),
    "engram_head_dim": ("engram_head_dim",),
    "engram_vocab_size": ("engram_vocab_size",),
    "engram_pad_token_id": ("engram_pad_token_id", "engram_pad_id"),
    "engram_compressed_vocab_size": ("engram_compressed_vocab_size",),
    # reference-backbone geometry (optional: the emulated backbone needs none of it)
    "n_heads": ("n_heads", "num_attention_heads"),
    "head_dim": ("head_dim",),
    "inter_dim": ("inter_dim", "intermediate_size"),
    "rope_theta": ("rope_theta",),
    "norm_eps": ("norm_eps", "rms_norm_eps"),
    "max_seq_len": ("max_seq_len", "max_position_embeddings"),
}
_REQUIRED = (
    "vocab_size", "dim", "n_layers", "hc_mult", "engram_layer_ids", "engram_num_embeddings",
    "engram_max_ngram_size", "engram_n_heads", "engram_head_dim", "engram_vocab_size",
    "engram_pad_token_id", "engram_compressed_vocab_size",
)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    dim: int
    n_layers: int
    hc_mult: int
    engram_layer_ids: tuple[int, ...]
    engram_num_embeddings: tuple[int, ...]
    engram_max_ngram_size: int
    engram_n_heads: int
    engram_head_dim: int
    engram_vocab_size: int
    engram_pad_token_id: int
    engram_compressed_vocab_size: int
    n_heads: int | None = None
    head_dim: int | None = None
    inter_dim: int | None = None
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    max_seq_len: int = 65536  # a runtime limit (caches), not model shape

    def __post_init__(self) -> None:
        """Every value checked at construction, whoever builds the config; errors name the key."""
        for name in ("vocab_size", "dim", "n_layers", "hc_mult", "engram_max_ngram_size", "engram_n_heads",
                     "engram_head_dim", "engram_vocab_size", "engram_compressed_vocab_size", "max_seq_len"):
            _as_int(name, getattr(self, name), 1)
        for name in ("n_heads", "head_dim", "inter_dim"):
            if getattr(self, name) is not None:
                _as_int(name, getattr(self, name), 1)
        _as_int("engram_pad_token_id", self.engram_pad_token_id, 0)
        layer_ids = _as_int_list("engram_layer_ids", self.engram_layer_ids, 0)
        rows = _as_int_list("engram_num_embeddings", self.engram_num_embeddings, 1)
        object.__setattr__(self, "engram_layer_ids", layer_ids)
        object.__setattr__(self, "engram_num_embeddings", rows)
        for name in ("rope_theta", "norm_eps"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise EngramflowError(f"config key {name!r} must be a finite number > 0, got {_short(v)}")
            object.__setattr__(self, name, float(v))
        if len(rows) != len(layer_ids):
            raise EngramflowError(
                f"config key 'engram_num_embeddings' has {len(rows)} entries but 'engram_layer_ids' has {len(layer_ids)}")
        if list(layer_ids) != sorted(set(layer_ids)):
            raise EngramflowError(f"config key 'engram_layer_ids' must be strictly increasing, got {_short(list(layer_ids))}")
        if layer_ids[-1] >= self.n_layers:
            raise EngramflowError(
                f"config key 'engram_layer_ids' names layer {layer_ids[-1]} but the model has n_layers={self.n_layers}")
        if self.engram_max_ngram_size < 2:
            raise EngramflowError(f"config key 'engram_max_ngram_size' must be >= 2, got {self.engram_max_ngram_size}")
        if self.engram_pad_token_id >= self.vocab_size:
            raise EngramflowError(f"config key 'engram_pad_token_id'={self.engram_pad_token_id} is outside the "
                                  f"vocabulary (vocab_size={self.vocab_size})")
        if self.engram_compressed_vocab_size > self.vocab_size:
            raise EngramflowError(f"config key 'engram_compressed_vocab_size'={self.engram_compressed_vocab_size} "
                                  f"exceeds vocab_size={self.vocab_size}")
        if self.engram_head_dim % 32:
            raise EngramflowError(f"config key 'engram_head_dim' must be a multiple of 32 (one E8M0 scale per 32 "
                                  f"values), got {self.engram_head_dim}")
        _check_limits(self)

    @property
    def engram_columns(self) -> int:
        """Hash columns per Engram layer: (max_ngram − 1) n-gram sizes × heads (24 for V4.1)."""
        return (self.engram_max_ngram_size - 1) * self.engram_n_heads

    @property
    def engram_input_dim(self) -> int:
        """Width of one position's looked-up rows: columns × head_dim (6,144 for V4.1)."""
        return self.engram_columns * self.engram_head_dim

    @property
    def engram_output_dim(self) -> int:
        """wkv output width: hc key streams plus one value (25,600 for V4.1)."""
        return self.dim * (self.hc_mult + 1)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["engram_layer_ids"] = list(self.engram_layer_ids)
        d["engram_num_embeddings"] = list(self.engram_num_embeddings)
        return {k: v for k, v in d.items() if v is not None}

    def replace(self, **changes: Any) -> "ModelConfig":
        return from_dict(self.to_dict() | changes)


# Upper bounds of every integer key, for ModelConfig and the V4.1 view alike: far above any real
# model (V4.1 Flash in brackets), low enough that a typo cannot hang the layout's prime search,
# size an absurd allocation or loop (the V4.1 name set alone is n_layers x n_routed_experts x 6).
LIMITS: dict[str, int] = {
    "vocab_size": 2**31 - 1,           # token ids are int32 on the way to the GPU [129,280]
    "dim": 1 << 18,                    # [5,120]
    "n_layers": 4096,                  # [40]
    "hc_mult": 64,                     # [4]
    "engram_max_ngram_size": 16,       # [4]
    "engram_n_heads": 256,             # [8]
    "engram_head_dim": 1 << 14,        # [256]
    "engram_vocab_size": 1 << 40,      # the prime search starts here [16,000,000]
    "n_heads": 1 << 14,
    "head_dim": 1 << 14,
    "inter_dim": 1 << 22,
    "max_seq_len": 1 << 26,            # a runtime limit [1M context]
    # V4.1 backbone keys (model/v41/config.py)
    "rope_head_dim": 1 << 14, "q_lora_rank": 1 << 18, "o_groups": 1 << 14, "o_lora_rank": 1 << 18,
    "window_size": 1 << 26, "index_n_heads": 1 << 14, "index_head_dim": 1 << 14, "index_topk": 1 << 26,
    "hc_sinkhorn_iters": 10_000, "n_routed_experts": 1 << 14, "n_activated_experts": 1 << 14,
    "moe_inter_dim": 1 << 20, "original_seq_len": 1 << 26, "beta_fast": 1 << 16, "beta_slow": 1 << 16,
    "n_mtp_layers": 64, "candidate_topk_blocks": 1 << 26, "candidate_block_size": 1 << 26,
}
MODEL_LIMITS = ("vocab_size", "dim", "n_layers", "hc_mult", "engram_max_ngram_size", "engram_n_heads",
                "engram_head_dim", "engram_vocab_size", "n_heads", "head_dim", "inter_dim", "max_seq_len")
MAX_ENGRAM_ROWS = 1 << 40              # rows per Engram table [384,016,682]
MAX_ENGRAM_LAYERS = 64                 # [2]
MAX_ENGRAM_PRIMES = 1024               # Engram layers x hash columns: the layout's primes [48]


def _check_limits(c: "ModelConfig") -> None:
    for name in MODEL_LIMITS:
        v, limit = getattr(c, name), LIMITS[name]
        if v is not None and v > limit:
            raise EngramflowError(f"config key {name!r}={v} is above the limit of {limit}")
    for rows in c.engram_num_embeddings:
        if rows > MAX_ENGRAM_ROWS:
            raise EngramflowError(f"config key 'engram_num_embeddings' holds {rows}, above the limit of "
                                  f"{MAX_ENGRAM_ROWS} rows per table")
    if len(c.engram_layer_ids) > MAX_ENGRAM_LAYERS:
        raise EngramflowError(f"config key 'engram_layer_ids' lists {len(c.engram_layer_ids)} layers, above the "
                              f"limit of {MAX_ENGRAM_LAYERS}")
    primes = len(c.engram_layer_ids) * c.engram_columns
    if primes > MAX_ENGRAM_PRIMES:
        raise EngramflowError(
            f"config keys 'engram_layer_ids' x ('engram_max_ngram_size' - 1) x 'engram_n_heads' = "
            f"{len(c.engram_layer_ids)} x {c.engram_max_ngram_size - 1} x {c.engram_n_heads} = {primes} hash "
            f"columns, above the limit of {MAX_ENGRAM_PRIMES} (each needs its own prime)")


def text_keys(raw: dict[str, Any]) -> dict[str, Any]:
    """The text model's keys: top-level ones, overridden by those under `text_config` (the one
    place the two layouts are merged)."""
    inner = raw.get("text_config")
    return {**raw, **inner} if isinstance(inner, dict) else dict(raw)


def pick(merged: dict[str, Any], name: str, default: Any = None) -> Any:
    """The value of `name` under any of its spellings (`merged`: from text_keys); both spellings
    must agree."""
    found = [(k, merged[k]) for k in _ALIASES.get(name, (name,)) if k in merged]
    if len(found) > 1 and any(v != found[0][1] for _, v in found[1:]):
        spelled = ", ".join(f"{k}={_short(v)}" for k, v in found)
        raise EngramflowError(f"config key {name!r} is given twice with different values: {spelled}")
    return found[0][1] if found else default


def _short(value: Any, limit: int = 80) -> str:
    s = repr(value)
    return s if len(s) <= limit else s[:limit] + "..."


def _as_int(name: str, value: Any, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise EngramflowError(f"config key {name!r} must be an integer >= {minimum}, got {_short(value)}")
    return value


def _as_int_list(name: str, value: Any, minimum: int = 0) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)) or not value:
        raise EngramflowError(f"config key {name!r} must be a non-empty list of integers, got {_short(value)}")
    return tuple(_as_int(name, v, minimum) for v in value)


def from_dict(raw: dict[str, Any]) -> ModelConfig:
    """Build a config from a parsed `config.json` (flat or under `text_config`, either spelling of
    each key); ModelConfig validates the values."""
    if not isinstance(raw, dict):
        raise EngramflowError(f"config must be a JSON object, got {type(raw).__name__}")
    merged = text_keys(raw)
    values = {name: pick(merged, name) for name in _ALIASES}
    for name in _REQUIRED:
        if values[name] is None:
            raise EngramflowError(f"config key {name!r} is missing (accepted spellings: {', '.join(_ALIASES[name])})")
    return ModelConfig(**{k: v for k, v in values.items() if v is not None})


MAX_JSON_BYTES = 64 << 20  # config.json and index files: the released ones are kilobytes / ~10 MB


def read_json_file(path: str | Path, what: str, limit: int = MAX_JSON_BYTES) -> Any:
    """Parse an outside JSON file (config.json, a safetensors index): bounded size, UTF-8, valid
    JSON without NaN literals, duplicate keys or absurd nesting; errors are one line naming it."""
    path = Path(path)
    try:
        size = path.stat().st_size
        if size > limit:
            raise EngramflowError(f"{what} {path} is {size} bytes, above the limit of {limit}")
        raw = path.read_bytes()
    except IsADirectoryError:
        raise EngramflowError(f"{what} {path} is a directory") from None
    except FileNotFoundError:
        raise EngramflowError(f"{what} not found: {path}") from None
    except PermissionError:
        raise EngramflowError(f"{what} {path} is not readable (permission denied)") from None
    return parse_json(raw, f"{what} {path}")


def load_raw(path: str | Path) -> dict[str, Any]:
    """`config.json` (or a checkpoint directory holding one) as a checked JSON object."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise EngramflowError(f"config file not found: {path}")
    raw = read_json_file(path, "config file")
    if not isinstance(raw, dict):
        raise EngramflowError(f"config file {path} must hold a JSON object, got {type(raw).__name__}")
    if "text_config" in raw and not isinstance(raw["text_config"], dict):
        raise EngramflowError(f"config file {path}: key 'text_config' must be an object, "
                              f"got {type(raw['text_config']).__name__}")
    return raw


def load(path: str | Path) -> ModelConfig:
    """Read `config.json` (or a checkpoint directory holding one)."""
    return from_dict(load_raw(path))
