"""Read one layer range's V4.1 weights from a checkpoint in the released format, checked.

Every tensor's name, shape and stored dtype come from names.py (`tensor_specs`, the one
place they are written; validation and `inspect` use the same table): FP8 E4M3 weights with
E8M0 32x32 tile scales (`.scale`), FP4 routed experts as packed bytes with E8M0 per-32 scales,
`wo_a` stored FP8 + scale and used in bf16, the ratio>1 compressor and the head used in fp32
(docs/v41.md, "Tensors"). Each problem is one error naming the tensor, what was expected and
what was found. Only the tensors of the requested layers (plus the embedding / norm and head
when asked) are read.
"""
from __future__ import annotations

import torch

from engramflow.errors import EngramflowError
from engramflow.io.checkpoint import Checkpoint
from engramflow.kernels.quant import QuantWeight
from engramflow.model.v41.attention import AttentionWeights
from engramflow.model.v41.block import Block
from engramflow.model.v41.compressor import CompressorWeights
from engramflow.model.v41.config import V41Config
from engramflow.model.v41.indexer import IndexerWeights
from engramflow.model.v41.hc import HyperMix
from engramflow.model.v41.moe import ExpertWeights, MoE, MoEWeights
from engramflow.model.v41.names import tensor_specs


class WeightReader:
    def __init__(self, ckpt: Checkpoint, cfg: V41Config, device: str | torch.device = "cpu"):
        self.ckpt, self.device = ckpt, torch.device(device)
        self.specs = tensor_specs(ckpt.raw_config, cfg)

    def _raw(self, name: str) -> torch.Tensor:
        spec = self.specs.get(name)
        info = self.ckpt.tensors.get(name)
        if spec is None or info is None:
            raise EngramflowError(f"{self.ckpt.root}: V4.1 tensor {name!r} is missing")
        if info.dtype not in spec.dtypes or tuple(info.shape) != spec.shape:
            raise EngramflowError(f"{info.file.name}: tensor {name!r} expected {'/'.join(spec.dtypes)} "
                                  f"{list(spec.shape)}, found {info.dtype} {list(info.shape)}")
        return self.ckpt.tensor(name)

    def dense(self, name: str, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """A bf16/fp32 tensor used in `dtype` (bf16 -> fp32 is exact; fp32 -> bf16 rounds once)."""
        return self._raw(name).to(self.device, dtype)

    def fp8(self, prefix: str) -> QuantWeight:
        return QuantWeight.fp8(self._raw(f"{prefix}.weight"), self._raw(f"{prefix}.scale")).to(self.device)

    def fp4(self, prefix: str) -> QuantWeight:
        return QuantWeight.fp4(self._raw(f"{prefix}.weight"), self._raw(f"{prefix}.scale")).to(self.device)

    def fp8_as_bf16(self, prefix: str) -> torch.Tensor:
        """`wo_a`: stored FP8 + scale, dequantised once (exactly) and used in bf16."""
        return self.fp8(prefix).dequantized().to(torch.bfloat16)


def attention_weights(r: WeightReader, p: str) -> AttentionWeights:
    return AttentionWeights(
        wq_a=r.fp8(f"{p}.wq_a"),
        q_norm=r.dense(f"{p}.q_norm.weight"),
        wq_b=r.fp8(f"{p}.wq_b"),
        wkv=r.fp8(f"{p}.wkv"),
        kv_norm=r.dense(f"{p}.kv_norm.weight"),
        wo_a=r.fp8_as_bf16(f"{p}.wo_a"),
        wo_b=r.fp8(f"{p}.wo_b"),
        sink=r.dense(f"{p}.attn_sink", torch.float32),
    )


def compressor_weights(r: WeightReader, p: str, ratio: int) -> CompressorWeights:
    return CompressorWeights(
        wkv=r.dense(f"{p}.wkv.weight", torch.float32 if ratio > 1 else torch.bfloat16),
        wgate=r.dense(f"{p}.wgate.weight", torch.float32) if ratio > 1 else None,
        norm=r.dense(f"{p}.norm.weight"),
    )


def indexer_weights(r: WeightReader, p: str, owns_keys: bool) -> IndexerWeights:
    return IndexerWeights(
        wq_b=r.fp8(f"{p}.wq_b"),
        weights_proj=r.dense(f"{p}.weights_proj.weight"),
        wk=r.dense(f"{p}.wk.weight") if owns_keys else None,
        k_norm=r.dense(f"{p}.k_norm.weight") if owns_keys else None,
    )


def moe_weights(r: WeightReader, c: V41Config, p: str) -> MoEWeights:
    def expert(q: str, read) -> ExpertWeights:
        return ExpertWeights(read(f"{q}.w1"), read(f"{q}.w2"), read(f"{q}.w3"))

    return MoEWeights(
        gate=r.dense(f"{p}.gate.weight", torch.float32),
        bias=r.dense(f"{p}.gate.bias", torch.float32),
        experts=[expert(f"{p}.experts.{e}", r.fp4) for e in range(c.n_routed_experts)],
        shared=expert(f"{p}.shared_experts", r.fp8),
    )


def block_around(r: WeightReader, c: V41Config, index: int, p: str, attn) -> Block:
    """The block at prefix `p` around `attn`: its MoE, hyper-connection mixes and norms (a
    backbone layer and a draft layer alike)."""
    def mix(side: str) -> HyperMix:
        return HyperMix(r.dense(f"{p}.hc_{side}_fn", torch.float32), r.dense(f"{p}.hc_{side}_base", torch.float32),
                        r.dense(f"{p}.hc_{side}_scale", torch.float32),
                        c.hc_mult, c.hc_sinkhorn_iters, c.hc_eps, c.norm_eps)

    moe = moe_weights(r, c, f"{p}.ffn")
    if f"{p}.ffn.gate.bias_vl" in r.specs:  # checkpoints with a vision tower route image-span tokens apart
        moe.bias_vl = r.dense(f"{p}.ffn.gate.bias_vl", torch.float32)
    return Block(index, attn, MoE(c, moe), mix("attn"), mix("ffn"),
                 r.dense(f"{p}.attn_norm.weight"), r.dense(f"{p}.ffn_norm.weight"), c.norm_eps)
