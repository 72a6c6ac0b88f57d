"""The V4.1 text model's view of `config.json` and the role of every layer (docs/v41.md).

The file is read and merged once (io/config.py: `text_keys`, `pick`, one table of LIMITS);
this view checks the backbone's own keys against the same limits. Roles
follow from the source lists by one rule: a compressed layer reads the latest KV source and the
latest index source at or before it; an index source takes its keys from the latest KV source
at or before it. Schedules that break the rule (a consumer before any source, a source of
another ratio, a list of the wrong length) are refused with the key named.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

from engramflow.errors import EngramflowError
from engramflow.io.config import LIMITS, pick, text_keys
from engramflow.io.config import _short  # one way to quote a bad value in a message

V41_MARKER = "compress_ratios"  # a config with this key describes a V4.1 backbone

_INT_KEYS = ("vocab_size", "dim", "n_layers", "n_heads", "head_dim", "rope_head_dim", "q_lora_rank",
             "o_groups", "o_lora_rank", "window_size", "index_n_heads", "index_head_dim", "index_topk",
             "hc_mult", "hc_sinkhorn_iters", "n_routed_experts", "n_activated_experts", "moe_inter_dim",
             "original_seq_len", "beta_fast", "beta_slow")
_FLOAT_KEYS = ("rope_theta", "compress_rope_theta", "rope_factor", "norm_eps", "hc_eps", "route_scale")
_MAX_RATIO = 1 << 16  # compress_ratios [4, 128]


@dataclasses.dataclass(frozen=True)
class LayerRole:
    layer: int
    ratio: int                 # 0: window only; r: compressed KV, one row per r tokens
    kv_source: int | None      # the layer whose compressed KV this one reads (itself for a source)
    index_source: int | None   # the layer whose top-k this one uses (itself for an index source)
    key_source: int | None     # for an index source: the layer whose index keys it scores
    candidate_source: bool     # publishes the candidate-block mask
    uses_candidates: bool      # an index source after the candidate source: masks its scores

    @property
    def compresses(self) -> bool:
        return self.ratio > 0 and self.kv_source == self.layer

    @property
    def indexes(self) -> bool:
        return self.ratio > 0 and self.index_source == self.layer

    @property
    def owns_keys(self) -> bool:
        return self.indexes and self.key_source == self.layer

    @property
    def kind(self) -> str:
        """The block type, as the official schedule names them (for reports)."""
        if self.ratio == 0:
            return "window only"
        if self.candidate_source:
            return f"candidate source (r{self.ratio})"
        if self.compresses:
            return f"KV+index source (r{self.ratio})"
        if self.indexes:
            return f"index source (r{self.ratio})"
        return f"consumer (r{self.ratio})"


@dataclasses.dataclass(frozen=True)
class V41Config:
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    head_dim: int
    rope_head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    window_size: int
    compress_ratios: tuple[int, ...]
    kv_source_layers: tuple[int, ...]
    index_source_layers: tuple[int, ...]
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    n_routed_experts: int
    n_activated_experts: int
    moe_inter_dim: int
    score_func: str
    route_scale: float
    rope_theta: float
    compress_rope_theta: float
    original_seq_len: int
    rope_factor: float
    beta_fast: int
    beta_slow: int
    norm_eps: float
    swiglu_limit: float = 0.0
    norm_topk_prob: bool = True
    gate_temp: float = 1.0
    n_shared_experts: int = 1
    candidate_source_layer: int = -1
    candidate_topk_blocks: int = 0
    candidate_block_size: int = 0
    engram_layer_ids: tuple[int, ...] = ()
    roles: tuple[LayerRole, ...] = ()

    def __post_init__(self) -> None:
        """Shapes and the schedule checked at construction; the layer roles derived once."""
        _check_shapes(self)
        if not self.roles:
            object.__setattr__(self, "roles", layer_roles(self))


def _get(raw: dict, key: str, default: Any = dataclasses.MISSING) -> Any:
    v = pick(raw, key, dataclasses.MISSING)
    if v is not dataclasses.MISSING:
        return v
    if default is dataclasses.MISSING:
        raise EngramflowError(f"V4.1 config key {key!r} is missing")
    return default


def _int(raw: dict, key: str, minimum: int = 1, default: Any = dataclasses.MISSING) -> int:
    v = _get(raw, key, default)
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise EngramflowError(f"V4.1 config key {key!r} must be an integer >= {minimum}, got {_short(v)}")
    if key in LIMITS and v > LIMITS[key]:
        raise EngramflowError(f"V4.1 config key {key!r}={v} is above the limit of {LIMITS[key]}")
    return v


def _float(raw: dict, key: str, default: Any = dataclasses.MISSING, positive: bool = True) -> float:
    v = _get(raw, key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or (positive and v <= 0) or v < 0:
        raise EngramflowError(f"V4.1 config key {key!r} must be a finite number {'> 0' if positive else '>= 0'}, "
                              f"got {_short(v)}")
    return float(v)


def _int_list(raw: dict, key: str, default: Any = dataclasses.MISSING) -> tuple[int, ...]:
    v = _get(raw, key, default)
    if not isinstance(v, (list, tuple)) or any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in v):
        raise EngramflowError(f"V4.1 config key {key!r} must be a list of integers >= 0, got {_short(v)}")
    return tuple(v)


def _latest(sources: tuple[int, ...], layer: int) -> int | None:
    before = [s for s in sources if s <= layer]
    return max(before) if before else None


def layer_roles(cfg: V41Config) -> tuple[LayerRole, ...]:
    ratios, cand = cfg.compress_ratios, cfg.candidate_source_layer
    roles = []
    for layer in range(cfg.n_layers):
        r = ratios[layer]
        if r == 0:
            roles.append(LayerRole(layer, 0, None, None, None, False, False))
            continue
        kv = _latest(cfg.kv_source_layers, layer)
        idx = _latest(cfg.index_source_layers, layer)
        if kv is None or idx is None:
            key = "kv_source_layers" if kv is None else "index_source_layers"
            raise EngramflowError(f"V4.1 config key {key!r}: layer {layer} (compress ratio {r}) comes before any source")
        for key, src in (("kv_source_layers", kv), ("index_source_layers", idx)):
            if ratios[src] != r:
                raise EngramflowError(f"V4.1 config key {key!r}: layer {layer} has compress ratio {r} but its "
                                      f"source, layer {src}, has ratio {ratios[src]}")
        key_src = _latest(cfg.kv_source_layers, idx)
        if key_src != kv:
            raise EngramflowError(f"V4.1 config key 'index_source_layers': layer {layer} reads compressed KV of "
                                  f"layer {kv} but top-k indices scored on layer {key_src}'s keys")
        if key_src not in cfg.index_source_layers:
            raise EngramflowError(f"V4.1 config key 'index_source_layers': index source {idx} reads keys of "
                                  f"KV source {key_src}, which is not an index source and so builds no keys")
        is_cand = layer == cand
        uses = 0 <= cand < layer and idx == layer
        if (is_cand or uses) and ratios[cand] != r:
            raise EngramflowError(f"V4.1 config key 'candidate_source_layer': layer {cand} has ratio {ratios[cand]}, "
                                  f"index source {layer} has ratio {r}")
        roles.append(LayerRole(layer, r, kv, idx, key_src if idx == layer else None, is_cand, uses))
    return tuple(roles)


def v41_from_dict(raw: dict[str, Any]) -> V41Config:
    """Parse and validate; errors name the key. Keys absent from the released config take the
    official code's defaults (norm_topk_prob True, gate_temp 1.0)."""
    if not isinstance(raw, dict):
        raise EngramflowError(f"config must be a JSON object, got {type(raw).__name__}")
    raw = text_keys(raw)
    vals: dict[str, Any] = {k: _int(raw, k, 0 if k in ("original_seq_len", "beta_fast", "beta_slow") else 1)
                            for k in _INT_KEYS}
    vals.update({k: _float(raw, k) for k in _FLOAT_KEYS})
    vals["swiglu_limit"] = _float(raw, "swiglu_limit", 0.0, positive=False)
    vals["gate_temp"] = _float(raw, "gate_temp", 1.0)
    vals["norm_topk_prob"] = bool(_get(raw, "norm_topk_prob", True))
    vals["n_shared_experts"] = _int(raw, "n_shared_experts", 1, 1)
    score = _get(raw, "score_func")
    if score not in ("softmax", "sigmoid", "sqrtsoftplus"):
        raise EngramflowError(f"V4.1 config key 'score_func' must be softmax, sigmoid or sqrtsoftplus, "
                              f"got {_short(score)}")
    vals["score_func"] = score
    n = vals["n_layers"]
    ratios = _int_list(raw, "compress_ratios")
    n_mtp = _int(raw, "n_mtp_layers", 0, 0)
    if len(ratios) not in (n, n + n_mtp) or any(r > 0 and r & (r - 1) or r > _MAX_RATIO for r in ratios):
        raise EngramflowError(f"V4.1 config key 'compress_ratios' must list a power-of-two ratio (or 0) for each "
                              f"of the {n} layers (optionally plus {n_mtp} MTP layers), at most {_MAX_RATIO}, "
                              f"got {len(ratios)} entries: {_short(list(ratios))}")
    vals["compress_ratios"] = ratios[:n]
    for key in ("kv_source_layers", "index_source_layers"):
        layers = _int_list(raw, key)
        bad = [x for x in layers if x >= n or ratios[x] == 0]
        if bad or list(layers) != sorted(set(layers)):
            raise EngramflowError(f"V4.1 config key {key!r} must list increasing compressed layers < {n}, "
                                  f"got {_short(list(layers))}")
        vals[key] = layers
    cand = _get(raw, "candidate_source_layer", -1)
    if isinstance(cand, bool) or not isinstance(cand, int) or not -1 <= cand < n:
        raise EngramflowError(f"V4.1 config key 'candidate_source_layer' must be an integer < {n} (-1 = off), "
                              f"got {_short(cand)}")
    vals["candidate_source_layer"] = cand
    if cand >= 0:
        if cand not in vals["index_source_layers"]:
            raise EngramflowError(f"V4.1 config key 'candidate_source_layer'={cand} is not an index source")
        vals["candidate_topk_blocks"] = _int(raw, "candidate_topk_blocks")
        vals["candidate_block_size"] = _int(raw, "candidate_block_size")
    vals["engram_layer_ids"] = _int_list(raw, "engram_layer_ids", ())
    return V41Config(**vals)


def _check_shapes(c: V41Config) -> None:
    def need(ok: bool, key: str, why: str) -> None:
        if not ok:
            raise EngramflowError(f"V4.1 config key {key!r}: {why}")
    need(c.rope_head_dim % 2 == 0 and c.rope_head_dim <= c.head_dim, "rope_head_dim", "must be even and <= head_dim")
    need(c.rope_head_dim <= c.index_head_dim, "index_head_dim", "must be >= rope_head_dim")
    need(c.n_heads % c.o_groups == 0, "o_groups", f"must divide n_heads={c.n_heads}")
    need(c.n_activated_experts <= c.n_routed_experts, "n_activated_experts", "must be <= n_routed_experts")
    need(c.n_shared_experts == 1, "n_shared_experts", "must be 1 (the official model has one shared expert)")
    for key in ("dim", "q_lora_rank", "head_dim", "moe_inter_dim", "index_head_dim"):
        need(getattr(c, key) % 32 == 0, key, "must be a multiple of 32 (FP8/FP4 blocks)")
    need(c.n_heads * c.head_dim // c.o_groups % 32 == 0, "o_groups", "group width must be a multiple of 32")
    need(c.head_dim % 16 == 0, "head_dim", "must be a multiple of 16")


def is_v41(raw: dict[str, Any]) -> bool:
    return isinstance(raw, dict) and V41_MARKER in text_keys(raw)
