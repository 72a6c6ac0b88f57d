"""Every built-in configuration, in one place.

* `deepseek-v4.1-flash`: the released model's Engram keys (what addressing needs).
* `tiny`, `v41-engram`, `v41-small`: the synthetic checkpoints `make-checkpoint` writes
  (model/synth.py); their Engram tables hold exactly the prime sums of their layouts.
`preset(name)` gives the validated ModelConfig; `preset_raw(name)` the config.json dict a
checkpoint of that preset carries (the official V4.1 keys for `v41-small`).
"""
from __future__ import annotations

from typing import Any

from engramflow.errors import EngramflowError
from engramflow.io.config import ModelConfig, from_dict
from engramflow.io.layout import build_layout

_FLASH: dict[str, Any] = {  # the released model's Engram keys
    "vocab_size": 129_280,
    "dim": 5_120,
    "n_layers": 40,
    "hc_mult": 4,
    "engram_layer_ids": [1, 14],
    "engram_num_embeddings": [384_006_168, 384_016_682],
    "engram_max_ngram_size": 4,
    "engram_n_heads": 8,
    "engram_head_dim": 256,
    "engram_vocab_size": 16_000_000,
    "engram_pad_token_id": 2,
    "engram_compressed_vocab_size": 99_092,
    "norm_eps": 1e-20,  # every text-model RMSNorm and the Engram gate (docs/v41.md, "Numerics")
}

# a whole V4.1 model in the released format at toy size: every layer role, Engram at two layers,
# the real V4 vocabulary, one MTP layer (official flat config.json keys)
_V41_SMALL: dict[str, Any] = {
    "vocab_size": 129_280, "dim": 128, "n_layers": 8, "n_mtp_layers": 1, "n_heads": 4, "head_dim": 64,
    "rope_head_dim": 16, "q_lora_rank": 64, "o_groups": 2, "o_lora_rank": 64, "window_size": 32,
    "compress_ratios": [0, 0, 2, 2, 2, 1, 1, 1, 0], "kv_source_layers": [2, 5], "index_source_layers": [2, 5, 7],
    "candidate_source_layer": 5, "candidate_topk_blocks": 4, "candidate_block_size": 4,
    "index_n_heads": 4, "index_head_dim": 32, "index_topk": 16,
    "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
    "n_routed_experts": 8, "n_activated_experts": 2, "n_shared_experts": 1, "moe_inter_dim": 64,
    "score_func": "sqrtsoftplus", "route_scale": 1.5, "swiglu_limit": 10.0,
    "rope_theta": 10000, "compress_rope_theta": 160000, "original_seq_len": 1024, "rope_factor": 16,
    "beta_fast": 32, "beta_slow": 1, "norm_eps": 1e-20, "max_seq_len": 4096,
    "engram_layer_ids": [1, 2], "engram_max_ngram_size": 4, "engram_n_heads": 8, "engram_head_dim": 32,
    "engram_vocab_size": 2_000, "engram_pad_id": 2, "engram_compressed_vocab_size": 99_092,
    "dtype": "fp8", "expert_dtype": "fp4",
    "dspark_block_size": 2, "dspark_noise_token_id": 128_799, "dspark_target_layer_ids": [5, 6, 7],
    "dspark_markov_rank": 32, "dspark_n_routed_experts": 4, "dspark_n_activated_experts": 2,
    # a small vision tower in the released names: 2 ViT blocks (patch 14, 3x3 aligner), images up to
    # 64 tokens, small ones scaled up to 84x84 pixels (a 2x2 token grid)
    "vision_n_layers": 2, "vision_dim": 64, "vision_n_heads": 4, "vision_inter_dim": 96, "vision_patch_size": 14,
    "vision_rope_theta": 10000.0, "vision_downsample_ratio": 3, "vision_max_n_token": 64,
    "vision_min_pixels": 84 * 84, "vision_max_wh_ratio": None, "image_token_id": 129_264,
}

_FLASH_GEOMETRY = {k: v for k, v in _FLASH.items() if k != "engram_num_embeddings"}  # rows from the layout

PRESETS: dict[str, dict[str, Any]] = {
    "deepseek-v4.1-flash": _FLASH,
    "tiny": _FLASH_GEOMETRY | {"dim": 64, "n_layers": 16, "engram_head_dim": 32, "engram_vocab_size": 3_000,
                      "n_heads": 4, "head_dim": 16, "inter_dim": 128, "max_seq_len": 4096},
    "v41-engram": _FLASH_GEOMETRY | {"engram_vocab_size": 169_000},
    "v41-small": _V41_SMALL,
}
SYNTHETIC = ("tiny", "v41-small", "v41-engram")  # make-checkpoint presets


def preset_raw(name: str, engram_vocab_size: int | None = None) -> dict[str, Any]:
    """The preset's config.json; a synthetic preset's Engram rows are its layout's prime sums."""
    if name not in PRESETS:
        raise EngramflowError(f"unknown preset {name!r}; known presets: {', '.join(sorted(PRESETS))}")
    raw = dict(PRESETS[name])
    if engram_vocab_size is not None:
        if isinstance(engram_vocab_size, bool) or not isinstance(engram_vocab_size, int) or engram_vocab_size < 2:
            raise EngramflowError(f"engram_vocab_size must be an integer >= 2, got {engram_vocab_size!r}")
        raw["engram_vocab_size"] = engram_vocab_size
    if "engram_num_embeddings" not in raw:
        probe = from_dict(raw | {"engram_num_embeddings": [1] * len(raw["engram_layer_ids"])})
        raw["engram_num_embeddings"] = [int(r) for r in build_layout(probe).rows_needed]
    return raw


def preset(name: str, engram_vocab_size: int | None = None) -> ModelConfig:
    return from_dict(preset_raw(name, engram_vocab_size))
