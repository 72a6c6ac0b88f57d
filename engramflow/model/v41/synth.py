"""`make-checkpoint --preset v41-small`: a seeded small V4.1 model in exactly the released format.

Every layer role of the schedule (window only; ratio-2 KV+index source with Engram; ratio-2
consumers; ratio-1 candidate source; ratio-1 consumer; ratio-1 index source), Engram at two
layers, the real V4 vocabulary (129,280 ids) and token map, one MTP layer (written, validated,
never loaded), FP8 weights with E8M0 32×32 tile scales, FP4 experts as packed bytes with E8M0
per-32 scales, `wo_a` stored FP8, head and ratio-2 compressor stored bf16. The name set comes
from names.tensor_specs, so it is the released one by construction.

Values: Gaussian weights scaled 1/sqrt(fan_in) and quantised the way the format requires, norms
near 1, a 0.1-RMS embedding; every tensor from its own generator (seed, crc32(name)), so adding
a tensor never moves another.
"""
from __future__ import annotations

import zlib

import numpy as np
import torch

from engramflow.kernels.quant import BLOCK, FP8_MAX, e2m1_round, pow2_ceil_scale
from engramflow.model.safetensors_io import TensorSpec
from engramflow.model.v41.names import BF16_OR_F32, FP4, FP8, tensor_specs

V41_SMALL = {
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
    "vision_n_layers": 0, "image_token_id": 129_264,
}


def _gen(seed: int, name: str) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))


def _tiles_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 [N, K] -> (E4M3 codes, E8M0 bytes per 32×32 tile), scale = 2^ceil(log2(amax/448))."""
    n, k = w.shape
    pad = -n % BLOCK
    t = torch.cat([w, w.new_zeros(pad, k)]).view(-1, BLOCK, k // BLOCK, BLOCK)
    scale = pow2_ceil_scale(t.abs().amax(dim=(1, 3)).clamp_min(1e-4), torch.tensor(1 / FP8_MAX))
    q = (t / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(-1, k)[:n].contiguous(), _e8m0_bytes(scale)


def _groups_fp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 [N, K] -> (packed E2M1 bytes [N, K/2], E8M0 bytes [N, K/32]), scale 2^ceil(log2(amax/6))."""
    g = w.view(w.shape[0], -1, BLOCK)
    scale = pow2_ceil_scale(g.abs().amax(-1).clamp_min(1e-4), torch.tensor(1 / 6.0))
    v = e2m1_round((g / scale.unsqueeze(-1)).clamp(-6, 6)).flatten(-2)
    mag = v.abs()
    code = torch.where(mag < 2, mag * 2, torch.where(mag < 4, mag + 2, mag / 2 + 4)).to(torch.uint8)
    code |= torch.signbit(v).to(torch.uint8) << 3
    return (code[:, 0::2] | (code[:, 1::2] << 4)).contiguous(), _e8m0_bytes(scale)


def _e8m0_bytes(scale: torch.Tensor) -> torch.Tensor:
    return ((scale.view(torch.int32) >> 23) & 0xFF).to(torch.uint8)


def _value(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = _gen(seed, name)
    randn = torch.randn(shape, generator=g)
    if len(shape) == 1 and "norm" in name:
        return 1 + 0.1 * randn
    if name == "embed.weight":
        return 0.1 * randn
    if len(shape) == 1:
        return 0.5 * randn if "sink" in name or "hc_" in name else 0.1 * randn
    return randn * shape[-1] ** -0.5


def _np(t: torch.Tensor) -> np.ndarray:
    if t.dtype == torch.bfloat16:
        return t.contiguous().view(torch.int16).numpy()
    if t.dtype == torch.float8_e4m3fn:
        return t.contiguous().view(torch.uint8).numpy()
    return t.contiguous().numpy()


def v41_backbone_specs(raw: dict, seed: int) -> list[TensorSpec]:
    """TensorSpecs for every non-Engram tensor of the config's released name set."""
    specs = []
    names = tensor_specs(raw)
    for name, spec in names.items():
        if spec.group.startswith("engram.") or name.endswith(".scale") or ".engram." in name:
            continue  # Engram tensors come from the Engram writer; scales go with their weight
        prefix = name[: -len(".weight")] if name.endswith(".weight") else name
        if spec.dtypes == FP8:
            q, s = _tiles_fp8(_value(name, spec.shape, seed))
            specs += [_spec(name, "F8_E4M3", q), _spec(f"{prefix}.scale", "F8_E8M0", s)]
        elif spec.dtypes == FP4:
            logical = (spec.shape[0], spec.shape[1] * 2)
            q, s = _groups_fp4(_value(name, logical, seed))
            specs += [_spec(name, "I8", q.view(torch.int8)), _spec(f"{prefix}.scale", "F8_E8M0", s)]
        elif spec.dtypes in (("BF16",), BF16_OR_F32):
            specs.append(_spec(name, "BF16", _value(name, spec.shape, seed).bfloat16()))
        else:
            specs.append(_spec(name, "F32", _value(name, spec.shape, seed)))
    return specs


def _spec(name: str, dtype: str, t: torch.Tensor) -> TensorSpec:
    data = _np(t)
    return TensorSpec(name, dtype, tuple(t.shape), lambda: [data])
