"""The `v41` backbone: the DeepSeek V4.1 Flash text model for one layer range (a stage).

    h = embed(ids) repeated into hc copies, pre = one-hot          [T, hc, dim] bf16
    per block i:  Engram_i(h) first when i is an Engram layer (K/V from the projection)
                  h, pre = Block_i(h, pre)
    last stage:   logits = head · norm(Σ_c pre[c]·h[c]) at the last position   [vocab] fp32

A stage boundary is a dict: h (the hc copies, fp32 holding bf16 values), `pre` (the next
collapse weights) and the shared state layers after the cut read from layers before it
(carry.py), so a cut may fall anywhere, even between a compressed-KV source and its consumers.
MTP/DSpark layers are not part of plain next-token decoding: not loaded. The vision tower runs
ahead of the first stage (vision/); its span rows arrive as `images` and replace embedding rows.
"""
from __future__ import annotations


import torch

from engramflow.errors import EngramflowError
from engramflow.kernels.gating import EngramGate
from engramflow.kernels import sum_order
from engramflow.kernels.dense_rows import dense_rows
from engramflow.model.backbone_base import BackboneStage, Segment, StageOutput, StageState
from engramflow.io.checkpoint import Checkpoint
from engramflow.model.v41.attention import Attention
from engramflow.model.v41.block import Block
from engramflow.model.v41.cache import BufferSpec, V41Cache
from engramflow.model.v41.carry import export, mirror_specs, needs_across, receive
from engramflow.model.v41.compressor import Compressor
from engramflow.model.v41.config import V41Config, v41_from_dict
from engramflow.model.v41.hc import collapse, identity_pre
from engramflow.model.v41.indexer import Indexer
from engramflow.model.v41.ops import rms_norm
from engramflow.model.v41.rope import Rotary, inverse_frequencies
from engramflow.model.v41.weights import (WeightReader, attention_weights, block_around, compressor_weights,
                                          indexer_weights)


def load_v41_config(ckpt: Checkpoint) -> V41Config:
    cfg = v41_from_dict(ckpt.raw_config)
    if cfg.engram_layer_ids != ckpt.config.engram_layer_ids:
        raise EngramflowError("V4.1 config key 'engram_layer_ids' disagrees with the Engram config")
    return cfg


def rotaries(cfg: V41Config) -> dict[int, Rotary]:
    """By compress ratio: window-only layers use rope_theta without YaRN, compressed ones
    compress_rope_theta with YaRN (when original_seq_len > 0)."""
    plain = Rotary(cfg.rope_head_dim, inverse_frequencies(cfg.rope_head_dim, cfg.rope_theta))
    yarn = Rotary(cfg.rope_head_dim, inverse_frequencies(cfg.rope_head_dim, cfg.compress_rope_theta,
                                                         cfg.original_seq_len, cfg.rope_factor,
                                                         cfg.beta_fast, cfg.beta_slow))
    return {r: plain if r == 0 else yarn for r in set(cfg.compress_ratios)}


def cache_specs(cfg: V41Config, blocks: range) -> dict[str, BufferSpec]:
    specs = {}
    for layer in blocks:
        role = cfg.roles[layer]
        specs[f"window.{layer}"] = BufferSpec(1, cfg.head_dim, torch.bfloat16)
        if role.compresses:
            specs[f"compressed.{layer}"] = BufferSpec(role.ratio, cfg.head_dim, torch.bfloat16)
            if role.ratio > 1:
                specs[f"carry_kv.{layer}"] = BufferSpec(1, cfg.head_dim, torch.float32)
                specs[f"carry_score.{layer}"] = BufferSpec(1, cfg.head_dim, torch.float32)
        if role.owns_keys:
            specs[f"index_keys.{layer}"] = BufferSpec(role.ratio, cfg.index_head_dim, torch.bfloat16)
    return specs


class V41Backbone(BackboneStage):
    def __init__(self, ckpt: Checkpoint, blocks: range, device: str | torch.device = "cpu",
                 first: bool | None = None, last: bool | None = None, numerics: str | None = None):
        self.v41 = cfg = load_v41_config(ckpt)
        specs = cache_specs(cfg, blocks) | mirror_specs(cfg, blocks)
        super().__init__(ckpt.config, blocks, first, last, V41Cache(specs, ckpt.config.max_seq_len, device), device,
                         numerics)
        self.hand_over = needs_across(cfg, blocks.stop)
        r = WeightReader(ckpt, cfg, self.device)
        rot = rotaries(cfg)
        self.embed = r.dense("embed.weight") if self.first else None
        self.layers = [self._block(r, cfg, layer, rot) for layer in blocks]
        self.gates = {layer: EngramGate(r.dense(f"layers.{layer}.engram.q_weight"),
                                        r.dense(f"layers.{layer}.engram.k_weight"),
                                        eps=cfg.norm_eps)
                      for layer in self.engram_layers}
        self.norm = r.dense("norm.weight") if self.last else None
        self.head = r.dense("head.weight", torch.float32) if self.last else None

    @staticmethod
    def _block(r: WeightReader, cfg: V41Config, layer: int, rot: dict[int, Rotary]) -> Block:
        role, p = cfg.roles[layer], f"layers.{layer}"
        rotary = rot[role.ratio]
        comp = (Compressor(layer, role.ratio, compressor_weights(r, f"{p}.attn.compressor", role.ratio),
                           rotary, cfg.norm_eps) if role.compresses else None)
        idx = (Indexer(cfg, role, indexer_weights(r, f"{p}.attn.indexer", role.owns_keys), rotary)
               if role.indexes else None)
        attn = Attention(cfg, role, attention_weights(r, f"{p}.attn"), rotary, comp, idx)
        return block_around(r, cfg, layer, p, attn)

    def _enter(self, segments: list[Segment], xs: list) -> StageState:
        cfg, hs, pres = self.v41, [], []
        for s, x in zip(segments, xs):
            s.extra["buffers"] = lambda name, session=s.session: self.cache.buffer(session, name)
            if self.first:
                hs.append(self.embed[x].unsqueeze(1).repeat(1, cfg.hc_mult, 1))
                pres.append(identity_pre(x.shape[0], cfg.hc_mult, self.device))
                s.extra["step"] = {}
            else:
                h, pre = self._boundary_in(x)
                hs.append(h)
                pres.append(pre)
                s.extra["step"] = receive(x, s.extra["buffers"], self.device)
        return StageState(segments, torch.cat(hs), {"pre": torch.cat(pres)})

    def _run_block(self, block: int, state: StageState, started_s: float, wait_ms: float) -> None:
        e = state.extra
        state.h, e["pre"] = self.layers[block - self.blocks.start](state.h, e["pre"], state.segments, state.dead)

    def _merge_images(self, state: StageState, images: list) -> None:
        """Image span rows replace the embedding rows (every hc copy) at their rows of the step."""
        n = state.h.shape[0]
        for offset, rows in images:
            if not (0 <= offset and offset + rows.shape[0] <= n) or tuple(rows.shape[1:]) != (self.v41.dim,):
                raise EngramflowError(f"image rows {tuple(rows.shape)} at offset {offset} do not fit a "
                                      f"{n}-token step of width {self.v41.dim}")
            state.h[offset:offset + rows.shape[0]] = rows.to(state.h.device, state.h.dtype).unsqueeze(1)

    def _normed(self, state: StageState, rows: torch.Tensor) -> torch.Tensor:
        """The final norm of the collapsed stream at the given rows, fp32."""
        h, pre = state.h[rows], state.extra["pre"][rows]
        return rms_norm(collapse(h, pre), self.norm, self.v41.norm_eps).float()

    def _predict(self, state: StageState, outs: list[StageOutput]) -> None:
        """Each segment's last row (a verifying one: every row), through the head together: one
        read of the head for the step (batched numerics); per row, as a decode step computes it,
        in official numerics."""
        segs = state.segments
        rows = torch.cat([torch.arange(s.a if s.verify else s.b - 1, s.b) for s in segs]).to(state.h.device)
        y = self._normed(state, rows)
        if sum_order.batch_invariant():
            logits = dense_rows(y, self.head)
        else:  # one GEMV per row, as a decode step computes its logits (a GEMM may sum in another order)
            logits = torch.stack([torch.nn.functional.linear(row, self.head) for row in y])
        at = 0
        for s, out in zip(segs, outs):
            n = s.n if s.verify else 1
            out.next_logits = logits[at:at + n] if s.verify else logits[at]
            out.logits = logits[at:at + n]
            out.tokens = logits[at + n - 1].argmax().view(1)
            at += n

    def _hand_over(self, state: StageState) -> list[dict]:
        return [self._segment_hand_over(state, s) for s in state.segments]

    def _segment_hand_over(self, state: StageState, s: Segment, needs=None) -> dict:
        return {"h": state.h[s.a:s.b].float(), "pre": state.extra["pre"][s.a:s.b]} \
            | export(needs or self.hand_over, s.extra["buffers"], s.extra["step"], s.start, s.end)

    def _boundary_in(self, x) -> tuple[torch.Tensor, torch.Tensor]:
        if not isinstance(x, dict) or not isinstance(x.get("pre"), torch.Tensor):
            raise EngramflowError(f"V4.1 stage starting at block {self.blocks.start} expects the previous V4.1 "
                                  f"stage's output (a dict with h and pre)")
        h, pre = x["h"], x["pre"]
        if tuple(pre.shape) != (h.shape[0], self.v41.hc_mult):
            raise EngramflowError(f"stage boundary 'pre' must be [{h.shape[0]}, {self.v41.hc_mult}], got {list(pre.shape)}")
        return h.to(torch.bfloat16), pre.to(self.device, torch.float32)
