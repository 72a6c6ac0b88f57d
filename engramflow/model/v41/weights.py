"""Read one layer range's V4.1 weights from a checkpoint in the released format, checked.

Names, shapes and dtypes are the official ones (V41_MODEL.md §11): FP8 E4M3 weights with E8M0
32×32 tile scales (`.scale`, F8_E8M0 or U8 bits), FP4 routed experts as packed bytes (I8/U8,
[out, in/2]) with E8M0 per-32 scales, `wo_a` stored FP8 + scale and used in bf16, the ratio>1
compressor and the head stored bf16 and used in fp32. Each problem is one error naming the
tensor, what was expected and what was found. Only the tensors of the requested layers (plus
the embedding / norm and head when asked) are read.
"""
from __future__ import annotations

import torch

from engramflow.errors import EngramflowError
from engramflow.kernels.formats import BLOCK
from engramflow.kernels.quant import QuantWeight
from engramflow.io.checkpoint import Checkpoint
from engramflow.model.v41.attention import AttentionWeights
from engramflow.model.v41.compressor import CompressorWeights
from engramflow.model.v41.config import V41Config
from engramflow.model.v41.indexer import IndexerWeights
from engramflow.model.v41.moe import ExpertWeights, MoEWeights

E8M0 = ("F8_E8M0", "U8")
FLOATS = ("BF16", "F32")


class WeightReader:
    def __init__(self, ckpt: Checkpoint, device: str | torch.device = "cpu"):
        self.ckpt, self.device = ckpt, torch.device(device)

    def _raw(self, name: str, dtypes: tuple[str, ...], shape: tuple[int, ...]) -> torch.Tensor:
        info = self.ckpt.tensors.get(name)
        if info is None:
            raise EngramflowError(f"{self.ckpt.root}: V4.1 tensor {name!r} is missing")
        if info.dtype not in dtypes or tuple(info.shape) != tuple(shape):
            raise EngramflowError(f"{info.file.name}: tensor {name!r} expected {'/'.join(dtypes)} {list(shape)}, "
                                  f"found {info.dtype} {list(info.shape)}")
        return self.ckpt.tensor(name)

    def dense(self, name: str, shape: tuple[int, ...], dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """A bf16/fp32 tensor used in `dtype` (bf16 -> fp32 is exact; fp32 -> bf16 rounds once)."""
        return self._raw(name, FLOATS, shape).to(self.device, dtype)

    def fp8(self, prefix: str, out_f: int, in_f: int) -> QuantWeight:
        codes = self._raw(f"{prefix}.weight", ("F8_E4M3",), (out_f, in_f))
        tiles = (-(-out_f // BLOCK), -(-in_f // BLOCK))
        scale = self._raw(f"{prefix}.scale", E8M0 + ("F32",), tiles)
        return QuantWeight.fp8(codes, scale).to(self.device)

    def fp4(self, prefix: str, out_f: int, in_f: int) -> QuantWeight:
        packed = self._raw(f"{prefix}.weight", ("I8", "U8"), (out_f, in_f // 2))
        scale = self._raw(f"{prefix}.scale", E8M0, (out_f, in_f // BLOCK))
        return QuantWeight.fp4(packed, scale).to(self.device)

    def bf16_or_fp8(self, prefix: str, out_f: int, in_f: int) -> torch.Tensor:
        """`wo_a`: stored FP8 + scale (dequantised once, exactly) or plain bf16."""
        info = self.ckpt.tensors.get(f"{prefix}.weight")
        if info is not None and info.dtype == "F8_E4M3":
            return self.fp8(prefix, out_f, in_f).dequantized().to(torch.bfloat16)
        return self.dense(f"{prefix}.weight", (out_f, in_f))


def attention_weights(r: WeightReader, c: V41Config, p: str) -> AttentionWeights:
    hd, heads = c.head_dim, c.n_heads
    return AttentionWeights(
        wq_a=r.fp8(f"{p}.wq_a", c.q_lora_rank, c.dim),
        q_norm=r.dense(f"{p}.q_norm.weight", (c.q_lora_rank,)),
        wq_b=r.fp8(f"{p}.wq_b", heads * hd, c.q_lora_rank),
        wkv=r.fp8(f"{p}.wkv", hd, c.dim),
        kv_norm=r.dense(f"{p}.kv_norm.weight", (hd,)),
        wo_a=r.bf16_or_fp8(f"{p}.wo_a", c.o_groups * c.o_lora_rank, heads * hd // c.o_groups),
        wo_b=r.fp8(f"{p}.wo_b", c.dim, c.o_groups * c.o_lora_rank),
        sink=r.dense(f"{p}.attn_sink", (heads,), torch.float32),
    )


def compressor_weights(r: WeightReader, c: V41Config, p: str, ratio: int) -> CompressorWeights:
    dtype = torch.float32 if ratio > 1 else torch.bfloat16
    return CompressorWeights(
        wkv=r.dense(f"{p}.wkv.weight", (c.head_dim, c.dim), dtype),
        wgate=r.dense(f"{p}.wgate.weight", (c.head_dim, c.dim), torch.float32) if ratio > 1 else None,
        norm=r.dense(f"{p}.norm.weight", (c.head_dim,)),
    )


def indexer_weights(r: WeightReader, c: V41Config, p: str, owns_keys: bool) -> IndexerWeights:
    return IndexerWeights(
        wq_b=r.fp8(f"{p}.wq_b", c.index_n_heads * c.index_head_dim, c.q_lora_rank),
        weights_proj=r.dense(f"{p}.weights_proj.weight", (c.index_n_heads, c.dim)),
        wk=r.dense(f"{p}.wk.weight", (c.index_head_dim, c.head_dim)) if owns_keys else None,
        k_norm=r.dense(f"{p}.k_norm.weight", (c.index_head_dim,)) if owns_keys else None,
    )


def moe_weights(r: WeightReader, c: V41Config, p: str) -> MoEWeights:
    inter, dim = c.moe_inter_dim, c.dim

    def expert(q: str, read) -> ExpertWeights:
        return ExpertWeights(read(f"{q}.w1", inter, dim), read(f"{q}.w2", dim, inter), read(f"{q}.w3", inter, dim))

    return MoEWeights(
        gate=r.dense(f"{p}.gate.weight", (c.n_routed_experts, dim), torch.float32),
        bias=r.dense(f"{p}.gate.bias", (c.n_routed_experts,), torch.float32),
        experts=[expert(f"{p}.experts.{e}", r.fp4) for e in range(c.n_routed_experts)],
        shared=expert(f"{p}.shared_experts", r.fp8),
    )
