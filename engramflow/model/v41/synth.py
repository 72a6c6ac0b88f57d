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

from engramflow.kernels.formats import BLOCK, FP8_MAX
from engramflow.kernels.quant import e2m1_round, pow2_ceil_scale
from engramflow.io.safetensors import TensorSpec
from engramflow.model.v41.names import BF16_OR_F32, FP4, FP8, tensor_specs



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
