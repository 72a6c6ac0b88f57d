"""Projection on the stage: rows in, (key, value) out, with the layer's own wkv.

A stage that receives rows (`EngramRows`) decodes them and projects them itself, then gates as
always. On a CPU stage that is the very `EngramProjection` the projection actors run (same
kernels, same numerics), so K/V are the same bits as host projection gives. On a GPU the wkv
goes to the device once: numerics "official" runs the V4.1 block-scaled FP8 GEMM
(`kernels.quant.quant_linear`, as on the host), "fast" a BF16 GEMM against the exactly
dequantised BF16 weight (K/V equal to the host's to BF16 rounding).
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from engramflow.errors import EngramflowError
from engramflow.kernels.formats import dequant_blocks
from engramflow.kernels.projection import EngramProjection
from engramflow.kernels.quant import QuantWeight, quant_linear
from engramflow.model.engram_rows import EngramRows


class DeviceProjection:
    """One layer's wkv on an accelerator: project(x [T, C] on the device) -> (key, value) fp32."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor | None, hc: int, dim: int,
                 device: torch.device, numerics: str):
        self.hc, self.dim = hc, dim
        self.official = None
        if numerics in ("official", "batched") and weight.dtype != torch.bfloat16:
            self.official = QuantWeight.fp8(weight.view(torch.float8_e4m3fn), scale).to(device)
        else:
            w = weight if weight.dtype == torch.bfloat16 else dequant_blocks(weight, scale, torch.bfloat16)
            self.weight = w.to(device)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x.to(torch.bfloat16)
        if self.official is not None:
            kv = quant_linear(x, self.official, torch.bfloat16).float()
        else:
            kv = torch.nn.functional.linear(x, self.weight).float()
        split = self.hc * self.dim
        return kv[:, :split].reshape(-1, self.hc, self.dim), kv[:, split:]


class StageProjector:
    """The wkv of the Engram layers a stage owns, and `project(layer, rows)`."""

    def __init__(self, get_tensor: Callable[[str], torch.Tensor], cfg, layers, device: torch.device | str,
                 numerics: str = "fast", threads: int | None = None):
        self.cfg = cfg
        self.device = torch.device(device)
        self.layers = tuple(layers)
        self.projections: dict[int, object] = {}
        for layer in self.layers:
            if self.device.type == "cpu":
                self.projections[layer] = EngramProjection.from_checkpoint(get_tensor, layer, cfg, threads=threads,
                                                                          numerics=numerics)
            else:
                prefix = f"layers.{layer}.engram.wkv"
                weight = get_tensor(f"{prefix}.weight")
                scale = None if weight.dtype == torch.bfloat16 else get_tensor(f"{prefix}.scale")
                self.projections[layer] = DeviceProjection(weight, scale, cfg.hc_mult, cfg.dim, self.device, numerics)

    def project(self, layer: int, rows: EngramRows) -> tuple[torch.Tensor, torch.Tensor]:
        """Decode the rows on this stage's device and project them: key [T, hc, dim], value [T, dim]."""
        if layer not in self.projections:
            raise EngramflowError(f"this stage projects Engram layers {list(self.layers)}, not {layer}")
        want = (self.cfg.engram_columns, self.cfg.engram_head_dim)
        if tuple(rows.codes.shape[1:]) != want:
            raise EngramflowError(f"Engram rows for layer {layer} must be [T, {want[0]}, {want[1]}], "
                                  f"got {list(rows.codes.shape)}")
        x = rows.decode(torch.bfloat16, self.device)
        return self.projections[layer].project(x)
