"""Every tensor a V4.1 checkpoint in the released format holds, with shape and stored dtype
(docs/v41.md, "Tensors"), derived from the config alone.

Each name belongs to a group: "embed", "head" (norm + head), "layer.{i}" (a backbone block,
Engram gate weights included), "engram.{i}" (the layer's table and wkv: the projection
actors'), "mtp" (DSpark layers) or "vision" (ViT, aligner, image tokens). The text model loads
embed, layer.*, head and engram.*; vision is known by name and validated, not loaded; mtp is
loaded only for speculative decoding (model/v41/dspark.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engramflow.io.config import pick, text_keys
from engramflow.model.v41.config import V41Config, v41_from_dict

FP8, E8M0, FP4, BF16, F32 = ("F8_E4M3",), ("F8_E8M0", "U8"), ("I8", "U8"), ("BF16",), ("F32",)
BF16_OR_F32 = ("BF16", "F32")  # fp32 in the model, bf16 in the released checkpoint


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtypes: tuple[str, ...]
    group: str


def _tiles(n: int) -> int:
    return -(-n // 32)


class _Specs(dict):
    def dense(self, name, shape, dtypes, group):
        self[name] = TensorSpec(tuple(shape), dtypes, group)

    def fp8(self, prefix, out_f, in_f, group):
        self.dense(f"{prefix}.weight", (out_f, in_f), FP8, group)
        self.dense(f"{prefix}.scale", (_tiles(out_f), _tiles(in_f)), E8M0, group)

    def fp4(self, prefix, out_f, in_f, group):
        self.dense(f"{prefix}.weight", (out_f, in_f // 2), FP4, group)
        self.dense(f"{prefix}.scale", (out_f, in_f // 32), E8M0, group)


def _block(s: _Specs, c: V41Config, p: str, group: str, ratio: int, role, experts: int, vision: bool) -> None:
    hc_mix, hc_dim = (2 + c.hc_mult) * c.hc_mult, c.hc_mult * c.dim
    for side in ("attn", "ffn"):
        s.dense(f"{p}.{side}_norm.weight", (c.dim,), BF16, group)
        s.dense(f"{p}.hc_{side}_fn", (hc_mix, hc_dim), F32, group)
        s.dense(f"{p}.hc_{side}_base", (hc_mix,), F32, group)
        s.dense(f"{p}.hc_{side}_scale", (3,), F32, group)
    a = f"{p}.attn"
    s.dense(f"{a}.attn_sink", (c.n_heads,), F32, group)
    s.fp8(f"{a}.wq_a", c.q_lora_rank, c.dim, group)
    s.dense(f"{a}.q_norm.weight", (c.q_lora_rank,), BF16, group)
    s.fp8(f"{a}.wq_b", c.n_heads * c.head_dim, c.q_lora_rank, group)
    s.fp8(f"{a}.wkv", c.head_dim, c.dim, group)
    s.dense(f"{a}.kv_norm.weight", (c.head_dim,), BF16, group)
    s.fp8(f"{a}.wo_a", c.o_groups * c.o_lora_rank, c.n_heads * c.head_dim // c.o_groups, group)
    s.fp8(f"{a}.wo_b", c.dim, c.o_groups * c.o_lora_rank, group)
    if role is not None and role.compresses:
        s.dense(f"{a}.compressor.wkv.weight", (c.head_dim, c.dim), BF16_OR_F32 if ratio > 1 else BF16, group)
        if ratio > 1:
            s.dense(f"{a}.compressor.wgate.weight", (c.head_dim, c.dim), BF16_OR_F32, group)
        s.dense(f"{a}.compressor.norm.weight", (c.head_dim,), BF16, group)
    if role is not None and role.indexes:
        s.fp8(f"{a}.indexer.wq_b", c.index_n_heads * c.index_head_dim, c.q_lora_rank, group)
        s.dense(f"{a}.indexer.weights_proj.weight", (c.index_n_heads, c.dim), BF16, group)
        if role.owns_keys:
            s.dense(f"{a}.indexer.wk.weight", (c.index_head_dim, c.head_dim), BF16, group)
            s.dense(f"{a}.indexer.k_norm.weight", (c.index_head_dim,), BF16, group)
    f = f"{p}.ffn"
    s.dense(f"{f}.gate.weight", (experts, c.dim), BF16, group)
    s.dense(f"{f}.gate.bias", (experts,), F32, group)
    if vision:
        s.dense(f"{f}.gate.bias_vl", (experts,), F32, group)
    for e in range(experts):
        for w, (o, i) in (("w1", (c.moe_inter_dim, c.dim)), ("w2", (c.dim, c.moe_inter_dim)),
                          ("w3", (c.moe_inter_dim, c.dim))):
            s.fp4(f"{f}.experts.{e}.{w}", o, i, group)
    for w, (o, i) in (("w1", (c.moe_inter_dim, c.dim)), ("w2", (c.dim, c.moe_inter_dim)),
                      ("w3", (c.moe_inter_dim, c.dim))):
        s.fp8(f"{f}.shared_experts.{w}", o, i, group)


def _get(raw: dict, key: str, default: Any) -> Any:
    return pick(text_keys(raw), key, default)


def tensor_specs(raw: dict[str, Any], cfg: V41Config | None = None) -> dict[str, TensorSpec]:
    """name -> TensorSpec for the whole released name set this config implies."""
    c = cfg or v41_from_dict(raw)
    vision = int(_get(raw, "vision_n_layers", 0) or 0) > 0
    s = _Specs()
    s.dense("embed.weight", (c.vocab_size, c.dim), BF16, "embed")
    for role in c.roles:
        i = role.layer
        _block(s, c, f"layers.{i}", f"layer.{i}", role.ratio, role, c.n_routed_experts, vision)
    rows = _get(raw, "engram_num_embeddings", [])
    head_dim, cols = _get(raw, "engram_head_dim", 0), (_get(raw, "engram_max_ngram_size", 1) - 1) * _get(raw, "engram_n_heads", 0)
    for layer, n_rows in zip(c.engram_layer_ids, rows):
        e = f"layers.{layer}.engram"
        s.dense(f"{e}.q_weight", (c.hc_mult, c.dim), BF16, f"layer.{layer}")
        s.dense(f"{e}.k_weight", (c.hc_mult, c.dim), BF16, f"layer.{layer}")
        s.dense(f"{e}.embed.weight", (n_rows, head_dim), FP8, f"engram.{layer}")
        s.dense(f"{e}.embed.scale", (n_rows, head_dim // 32), E8M0, f"engram.{layer}")
        s.fp8(f"{e}.wkv", c.dim * (c.hc_mult + 1), cols * head_dim, f"engram.{layer}")
    s.dense("norm.weight", (c.dim,), BF16, "head")
    s.dense("head.weight", (c.vocab_size, c.dim), BF16_OR_F32, "head")
    if int(_get(raw, "dspark_block_size", 0) or 0):
        _mtp(s, c, raw, vision)
    if vision:
        _vision(s, c, raw)
    return dict(s)


def _mtp(s: _Specs, c: V41Config, raw: dict, vision: bool) -> None:
    n = int(_get(raw, "n_mtp_layers", 0))
    experts = int(_get(raw, "dspark_n_routed_experts", 0) or c.n_routed_experts)
    targets = len(_get(raw, "dspark_target_layer_ids", ()))
    rank = int(_get(raw, "dspark_markov_rank", 256))
    for k in range(n):
        p = f"mtp.{k}"
        _block(s, c, p, "mtp", 0, None, experts, vision)
        if k == 0:
            s.fp8(f"{p}.main_proj", c.dim, targets * c.dim, "mtp")
            s.dense(f"{p}.main_norm.weight", (c.dim,), BF16, "mtp")
        if k == n - 1:
            s.dense(f"{p}.norm.weight", (c.dim,), BF16, "mtp")
            s.dense(f"{p}.markov_head.embed.weight", (c.vocab_size, rank), BF16, "mtp")
            s.dense(f"{p}.markov_head.head.weight", (c.vocab_size, rank), BF16_OR_F32, "mtp")
            s.dense(f"{p}.confidence_head.proj.weight", (1, c.dim + rank), BF16_OR_F32, "mtp")


def _vision(s: _Specs, c: V41Config, raw: dict) -> None:
    vdim, inter = int(_get(raw, "vision_dim", 1024)), int(_get(raw, "vision_inter_dim", 2816))
    patch, down = int(_get(raw, "vision_patch_size", 14)), int(_get(raw, "vision_downsample_ratio", 3))
    s.dense("vision.patch_embed.proj.weight", (vdim, 3 * patch * patch), BF16, "vision")
    s.dense("vision.patch_embed.proj.bias", (vdim,), BF16, "vision")
    for i in range(int(_get(raw, "vision_n_layers", 0))):
        b = f"vision.blocks.{i}"
        s.dense(f"{b}.norm1.weight", (vdim,), F32, "vision")
        s.dense(f"{b}.attn.wqkv.weight", (3 * vdim, vdim), BF16, "vision")
        s.dense(f"{b}.attn.wqkv.bias", (3 * vdim,), BF16, "vision")
        s.dense(f"{b}.attn.wo.weight", (vdim, vdim), BF16, "vision")
        s.dense(f"{b}.attn.wo.bias", (vdim,), BF16, "vision")
        s.dense(f"{b}.norm2.weight", (vdim,), F32, "vision")
        s.dense(f"{b}.mlp.w1.weight", (2 * inter, vdim), BF16, "vision")
        s.dense(f"{b}.mlp.w2.weight", (vdim, inter), BF16, "vision")
    s.dense("vision.norm.weight", (vdim,), F32, "vision")
    s.dense("aligner.w1.weight", (c.dim, vdim * down * down), BF16, "vision")
    s.dense("aligner.w1.bias", (c.dim,), BF16, "vision")
    s.dense("aligner.w2.weight", (c.dim, c.dim), BF16, "vision")
    s.dense("aligner.w2.bias", (c.dim,), BF16, "vision")
    for name in ("image_start", "image_end", "image_newline"):
        s.dense(name, (c.dim,), BF16, "vision")

