"""The `reference` backbone: a small causal decoder with hc residual streams (docs/architecture.md, "Backbones").

Just enough model for the whole Engram path to run end to end and be checked against an
in-process oracle; not the V4.1 backbone (no compressed sparse attention, MoE or mHC).

    h = embed(ids) broadcast to the hc streams                      [T, hc, dim]
    per block i:
        if i is an Engram layer: h = EngramGate(h, key_i, value_i)  (per stream, at block entry)
        h += attn(rmsnorm(mean_s h))       added to every stream
        h += swiglu(rmsnorm(mean_s h))     added to every stream
    logits = head(rmsnorm(mean_s h[last]))                          [1, vocab]

Stream mixing is the plain mean over the hc streams: the simplest mix that keeps every stream
in play, so what Engram writes into each stream reaches the next block. Weights are stored in
BF16 and computed in fp32.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engramflow.errors import EngramflowError
from engramflow.kernels.gating import EngramGate
from engramflow.kernels import rowwise
from engramflow.kernels.dense_rows import linear
from engramflow.model.backbone_base import (BackboneStage, Segment, StageOutput, StageState, rmsnorm,
                                            seeded_generator)
from engramflow.io.config import ModelConfig
from engramflow.model.kv_cache import KVCache

GetTensor = Callable[[str], torch.Tensor]


def _require_geometry(cfg: ModelConfig) -> None:
    missing = [k for k in ("n_heads", "head_dim", "inter_dim") if getattr(cfg, k) is None]
    if missing:
        raise EngramflowError(f"the reference backbone needs config key(s) {missing}")
    if cfg.head_dim % 2:
        raise EngramflowError(f"head_dim must be even for rotary embeddings, got {cfg.head_dim}")


def reference_specs(cfg: ModelConfig) -> dict[str, tuple[tuple[int, ...], float | None]]:
    """Every reference-backbone tensor by checkpoint name: (shape, std), std None for a weight
    that sits near 1 (norms, gates). The one list of names and shapes: the random weights are
    made from it and a checkpoint's tensors are checked against it when loaded.

    Scales: unit-variance embeddings; input projections 1/sqrt(fan_in) so pre-activations are
    O(1) after rmsnorm; each residual branch's output projection further shrunk by
    1/sqrt(2·n_layers) so the 2·n_layers branches add up to O(1) and the residual stays O(1);
    the head maps a unit-rms hidden state to O(1) logits, so greedy tokens follow the input
    instead of collapsing onto one id. Norm and gate weights sit near 1.
    """
    _require_geometry(cfg)
    dim, qdim, inter = cfg.dim, cfg.n_heads * cfg.head_dim, cfg.inter_dim
    branch = 1.0 / math.sqrt(2 * cfg.n_layers)
    specs: dict[str, tuple[tuple[int, ...], float | None]] = {"embed.weight": ((cfg.vocab_size, dim), 1.0)}
    for i in range(cfg.n_layers):
        p = f"layers.{i}"
        specs[f"{p}.attn_norm.weight"] = ((dim,), None)
        for w in ("wq", "wk", "wv"):
            specs[f"{p}.attn.{w}.weight"] = ((qdim, dim), dim ** -0.5)
        specs[f"{p}.attn.wo.weight"] = ((dim, qdim), branch * qdim ** -0.5)
        specs[f"{p}.ffn_norm.weight"] = ((dim,), None)
        specs[f"{p}.ffn.w1.weight"] = ((inter, dim), dim ** -0.5)
        specs[f"{p}.ffn.w3.weight"] = ((inter, dim), dim ** -0.5)
        specs[f"{p}.ffn.w2.weight"] = ((dim, inter), 2 * branch * inter ** -0.5)  # silu(a)·b has rms ~0.5
        if i in cfg.engram_layer_ids:
            specs[f"{p}.engram.q_weight"] = ((cfg.hc_mult, dim), None)
            specs[f"{p}.engram.k_weight"] = ((cfg.hc_mult, dim), None)
    specs["norm.weight"] = ((dim,), None)
    specs["head.weight"] = ((cfg.vocab_size, dim), dim ** -0.5)
    return specs


def reference_weights(cfg: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Deterministic random BF16 weights for the reference backbone, by checkpoint name
    (shapes and scales: `reference_specs`; near-1 weights spread by 0.1)."""
    out: dict[str, torch.Tensor] = {}
    for name, (shape, std) in reference_specs(cfg).items():
        noise = torch.randn(shape, generator=seeded_generator(seed, name))
        out[name] = (noise * std if std is not None else 1 + 0.1 * noise).to(torch.bfloat16)
    return out


def checked_loader(cfg: ModelConfig, get_tensor: GetTensor) -> GetTensor:
    """`get_tensor` that refuses a tensor whose shape is not the one the config implies, naming
    it (a wrong shape would otherwise surface as a bare matmul error deep in a forward)."""
    specs = reference_specs(cfg)

    def get(name: str) -> torch.Tensor:
        t = get_tensor(name)
        want = specs[name][0]
        if tuple(t.shape) != want:
            raise EngramflowError(f"tensor {name!r} has shape {list(t.shape)}, the config implies {list(want)}")
        return t

    return get


@dataclass
class _Block:
    attn_norm: torch.Tensor
    wq: torch.Tensor
    wk: torch.Tensor
    wv: torch.Tensor
    wo: torch.Tensor
    ffn_norm: torch.Tensor
    w1: torch.Tensor
    w2: torch.Tensor
    w3: torch.Tensor


def _rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding, rotate-half layout. x [T, H, D], positions int64 [T]."""
    half = x.shape[-1] // 2
    inv_freq = theta ** (-torch.arange(half, dtype=torch.float64, device=x.device) / half)
    # angles in float64: exact enough at any position, and identical for a position whether
    # it arrives in a prefill or in a decode step
    angles = (positions.to(torch.float64)[:, None] * inv_freq[None, :]).to(torch.float32)
    cos, sin = rowwise.cos(angles)[:, None, :], rowwise.sin(angles)[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


def _causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start_pos: int) -> torch.Tensor:
    """q [T, H, D] at positions start_pos.., k/v [S, H, D] at positions 0..S-1 -> [T, H·D]."""
    n, s = q.shape[0], k.shape[0]
    scores = torch.einsum("thd,shd->hts", q, k) * q.shape[-1] ** -0.5
    q_pos = torch.arange(start_pos, start_pos + n, device=q.device)
    k_pos = torch.arange(s, device=q.device)
    scores = scores.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))
    probs = rowwise.softmax(scores, dim=-1)
    return torch.einsum("hts,shd->thd", probs, v).reshape(n, -1)


class ReferenceBackbone(BackboneStage):
    def __init__(self, cfg: ModelConfig, get_tensor: GetTensor, blocks: range, device: str | torch.device = "cpu",
                 first: bool | None = None, last: bool | None = None, numerics: str | None = None):
        _require_geometry(cfg)
        cache = KVCache(len(blocks), cfg.n_heads, cfg.head_dim, cfg.max_seq_len, device)
        super().__init__(cfg, blocks, first, last, cache, device, numerics)
        get_tensor = checked_loader(cfg, get_tensor)

        def load(name: str) -> torch.Tensor:
            return get_tensor(name).to(self.device, torch.float32)

        self.embed = load("embed.weight") if self.first else None
        self.layers = [
            _Block(*(load(f"layers.{i}.{n}.weight") for n in (
                "attn_norm", "attn.wq", "attn.wk", "attn.wv", "attn.wo", "ffn_norm", "ffn.w1", "ffn.w2", "ffn.w3")))
            for i in self.blocks
        ]
        self.gates = {
            layer: EngramGate(get_tensor(f"layers.{layer}.engram.q_weight").float(),
                              get_tensor(f"layers.{layer}.engram.k_weight").float(), eps=cfg.norm_eps).to(self.device)
            for layer in self.engram_layers
        }
        self.norm = load("norm.weight") if self.last else None
        self.head = load("head.weight") if self.last else None

    def _block(self, index: int, h: torch.Tensor, segments: list[Segment]) -> torch.Tensor:
        """The linears take every row of the step at once; attention reads each session's own cache."""
        b, cfg = self.layers[index], self.cfg
        n = h.shape[0]
        x = rmsnorm(h.mean(dim=1), b.attn_norm, cfg.norm_eps)
        positions = torch.cat([torch.arange(s.start, s.end, device=h.device) for s in segments])
        q = _rope(linear(x, b.wq).view(n, cfg.n_heads, cfg.head_dim), positions, cfg.rope_theta)
        k = _rope(linear(x, b.wk).view(n, cfg.n_heads, cfg.head_dim), positions, cfg.rope_theta)
        v = linear(x, b.wv).view(n, cfg.n_heads, cfg.head_dim)
        attn = []
        for s in segments:
            k_cache, v_cache = self.cache.layer(s.session, index)
            k_cache[s.start:s.end] = k[s.a:s.b]
            v_cache[s.start:s.end] = v[s.a:s.b]
            attn.append(_causal_attention(q[s.a:s.b], k_cache[:s.end], v_cache[:s.end], s.start))
        h = h + linear(torch.cat(attn), b.wo)[:, None, :]
        x = rmsnorm(h.mean(dim=1), b.ffn_norm, cfg.norm_eps)
        return h + linear(rowwise.silu(linear(x, b.w1)) * linear(x, b.w3), b.w2)[:, None, :]

    def _enter(self, segments: list[Segment], xs: list) -> StageState:
        if self.first:
            h = torch.cat([F.embedding(x, self.embed)[:, None, :].expand(-1, self.cfg.hc_mult, -1) for x in xs])
        else:
            h = torch.cat(xs)
        return StageState(segments, h.contiguous())

    def _run_block(self, block: int, state: StageState, started_s: float, wait_ms: float) -> None:
        state.h = self._block(block - self.blocks.start, state.h, state.segments)

    def _predict(self, state: StageState, outs: list[StageOutput]) -> None:
        # each session's last position only: generation needs nothing else (a [T, vocab] product
        # would cost T times the head for numbers nobody reads); one head product for the step
        last = torch.stack([state.h[s.b - 1] for s in state.segments])
        logits = linear(rmsnorm(last.mean(dim=1), self.norm, self.cfg.norm_eps), self.head)
        for i, out in enumerate(outs):
            out.logits = logits[i:i + 1]
            out.tokens = out.logits.argmax(dim=-1)
            out.next_logits = logits[i]
