"""DSpark: V4.1's own draft layers (`mtp.*`), drafting a block of tokens per forward.

Main-model taps. The backbone hands over, for every position it runs, the input h of each
target layer (after that layer's Engram) averaged over the hc copies; the taps of one position
are concatenated in layer order: [T, n_targets·dim] bf16.

Ingest (every forward of the backbone, prefill chunk, decode step or verified block):
    main_x = main_norm(main_proj(taps))                                    [T, dim]
    ring_k[pos] = fp8QDQ(RoPE(kv_norm(wkv_k(main_x)), pos))   for each draft layer k
The official code keeps a `window`-slot ring; here every position has its row (like the window
cache of the backbone), so dropping positions is just a shorter session, and the ring is read
back slot by slot in the ring's order (the attention's online softmax is order sensitive).

Draft (after the main model has run positions < L, the next token `t` chosen):
    block = [t, noise, ..., noise] at positions L .. L+B−1, embedded, hc copies
    each draft layer: a V4.1 block whose attention attends, for every block query alike (non-
        causally), to the ring's min(window, L) slots and all B block positions
    x = collapse; logits_i = head(norm(x_i)) + markov(d_i), d_0 = t, d_{i+1} = choose(logits_i)
    confidence_i = proj([x_i, markov_embed(d_i)])
The Markov head is low rank: markov(d) = W_head · E[d]; each bias depends on the token chosen
just before, so the block's tokens are chosen one after another.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F

from engramflow.kernels import sum_order
from engramflow.kernels.quant import fp8_qdq
from engramflow.model.speculative import Draft
from engramflow.model.v41.attention import AttentionWeights
from engramflow.model.v41.block import Block
from engramflow.model.v41.cache import BufferSpec
from engramflow.model.v41.dspark_config import DSparkConfig
from engramflow.model.v41.hc import collapse, identity_pre
from engramflow.model.backbone_base import Segment
from engramflow.model.v41.ops import dense_linear, grouped_projection, linear, rms_norm
from engramflow.model.v41.rope import Rotary, inverse_frequencies
from engramflow.model.v41.sparse_attention import sparse_attention
from engramflow.model.v41.weights import WeightReader, attention_weights, block_around


class DraftAsk(NamedTuple):
    """One session's draft: after `token` at position `start`, its cache `buffers`, `choose(logits,
    i)` picks draft i (None: argmax), n drafts (None: the block size)."""
    token: int
    start: int
    buffers: Callable
    choose: Callable[[torch.Tensor, int], int] | None = None
    n: int | None = None


def ring_positions(end: int, window: int, device=None) -> torch.Tensor:
    """Positions in ring slots 0..min(window, end)−1 once positions < end are written: slot s
    holds the latest position p < end with p ≡ s (mod window)."""
    slots = torch.arange(min(window, end), device=device)
    return (end - 1) - (end - 1 - slots) % window


class DSparkAttention:
    """Window-only attention of a draft layer: the ring of main-model keys plus the block itself."""

    def __init__(self, dcfg: DSparkConfig, layer: int, w: AttentionWeights, rotary: Rotary):
        self.cfg, self.w, self.rotary = dcfg.moe, w, rotary
        self.ring = dcfg.ring(layer)
        self.scale = self.cfg.head_dim ** -0.5

    def keys(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Window keys of x at positions: fp8QDQ(RoPE(kv_norm(wkv(x)))) [T, head_dim] bf16."""
        kv = rms_norm(linear(x, self.w.wkv), self.w.kv_norm, self.cfg.norm_eps)
        return fp8_qdq(self.rotary.rotate(kv, positions))

    def __call__(self, x: torch.Tensor, segments) -> torch.Tensor:
        """x [rows, dim] bf16: one draft block per segment, each at its session's positions
        start.. (the main model has run positions < start). The projections run over every
        block's rows at once; each block attends to its own ring."""
        cfg, w = self.cfg, self.w
        pos = torch.cat([torch.arange(s.start, s.start + s.n, device=x.device) for s in segments])
        qr = rms_norm(linear(x, w.wq_a), w.q_norm, cfg.norm_eps)
        q = self.rotary.rotate(linear(qr, w.wq_b).unflatten(-1, (cfg.n_heads, cfg.head_dim)), pos)
        keys = self.keys(x, pos)
        outs = []
        for s in segments:
            ring = s.extra["buffers"](self.ring)[ring_positions(s.start, cfg.window_size, x.device)]
            rows = torch.cat([ring, keys[s.a:s.b]])
            lists = torch.arange(rows.shape[0], device=x.device).expand(s.n, -1)
            outs.append(sparse_attention(q[s.a:s.b], rows, w.sink, lists, self.scale))
        o = self.rotary.rotate(torch.cat(outs), pos, inverse=True)
        o = grouped_projection(o.view(x.shape[0], cfg.o_groups, -1), w.wo_a.view(cfg.o_groups, cfg.o_lora_rank, -1))
        return linear(o.flatten(1), w.wo_b)


def _draft_block(r: WeightReader, dcfg: DSparkConfig, k: int, rotary: Rotary) -> Block:
    c, p = dcfg.moe, f"mtp.{k}"
    return block_around(r, c, k, p, DSparkAttention(dcfg, k, attention_weights(r, f"{p}.attn"), rotary))


class DSpark:
    """The draft layers of one model, reading the backbone's embedding and head."""

    def __init__(self, r: WeightReader, dcfg: DSparkConfig, embed: torch.Tensor, head: torch.Tensor):
        c, last = dcfg.moe, f"mtp.{dcfg.n_layers - 1}"
        self.dcfg, self.cfg, self.embed, self.head = dcfg, c, embed, head
        rotary = Rotary(c.rope_head_dim, inverse_frequencies(c.rope_head_dim, c.rope_theta))
        self.layers = [_draft_block(r, dcfg, k, rotary) for k in range(dcfg.n_layers)]
        self.main_proj = r.fp8("mtp.0.main_proj")  # shapes: names.py (the draft layers' specs)
        self.main_norm = r.dense("mtp.0.main_norm.weight")
        self.norm = r.dense(f"{last}.norm.weight")
        self.markov_embed = r.dense(f"{last}.markov_head.embed.weight")
        self.markov_head = r.dense(f"{last}.markov_head.head.weight", torch.float32)
        self.confidence = r.dense(f"{last}.confidence_head.proj.weight", torch.float32)

    def cache_specs(self) -> dict[str, BufferSpec]:
        return {self.dcfg.ring(k): BufferSpec(1, self.cfg.head_dim, torch.bfloat16) for k in range(self.dcfg.n_layers)}

    def ingest(self, taps: torch.Tensor, start: int, buffers) -> None:
        """Write the ring rows of positions start.. from the main model's taps [T, n_targets·dim]."""
        main_x = rms_norm(linear(taps, self.main_proj), self.main_norm, self.cfg.norm_eps)
        pos = torch.arange(start, start + taps.shape[0], device=taps.device)
        for k, block in enumerate(self.layers):
            buffers(self.dcfg.ring(k))[start:start + taps.shape[0]] = block.attn.keys(main_x, pos)

    def draft(self, token: int, start: int, buffers, choose: Callable[[torch.Tensor, int], int] | None = None,
              n: int | None = None) -> Draft:
        """Draft n (default block_size) tokens after `token` at position `start` (the main model
        has run positions < start). `choose(logits, i)` picks draft i (default: argmax)."""
        return self.draft_many([DraftAsk(token, start, buffers, choose, n)])[0]

    def draft_many(self, asks: list[DraftAsk]) -> list[Draft]:
        """Every session's draft block in one forward of the draft layers: one read of their
        weights and of the head for all of them. Each block's rows are its own (row-invariant
        kernels in batched numerics), so a session's drafts do not depend on the others. In
        official numerics each block runs alone, as the official code drafts."""
        if len(asks) > 1 and not sum_order.batch_invariant():
            return [d for a in asks for d in self.draft_many([a])]
        b = self.dcfg.block_size
        ids = torch.full((len(asks) * b,), self.dcfg.noise_token_id, dtype=torch.int64, device=self.embed.device)
        ids[::b] = torch.tensor([a.token for a in asks], dtype=torch.int64, device=ids.device)
        h = self.embed[ids].unsqueeze(1).repeat(1, self.cfg.hc_mult, 1)
        pre = identity_pre(ids.numel(), self.cfg.hc_mult, h.device)
        segments = [Segment(f"draft{i}", i * b, (i + 1) * b, a.start, extra={"buffers": a.buffers, "step": {}})
                    for i, a in enumerate(asks)]
        for block in self.layers:
            h, pre = block(h, pre, segments)
        x = collapse(h, pre)
        logits = dense_linear(rms_norm(x, self.norm, self.cfg.norm_eps).float(), self.head)
        return [self._chosen(x[s.a:s.b], logits[s.a:s.b], a) for s, a in zip(segments, asks)]

    def _chosen(self, x: torch.Tensor, logits: torch.Tensor, ask: DraftAsk) -> Draft:
        """One block's tokens, one after another: each Markov bias depends on the token before."""
        n = self.dcfg.block_size if ask.n is None else ask.n
        chosen, embeds = [ask.token], []
        for i in range(n):
            e = self.markov_embed[chosen[-1]].view(1, -1)
            logits[i] += F.linear(e.float(), self.markov_head)[0]
            embeds.append(e[0])
            chosen.append(int(torch.argmax(logits[i])) if ask.choose is None else ask.choose(logits[i], i))
        hidden = torch.cat([x[:n], torch.stack(embeds)], dim=-1).float()
        confidence = F.linear(hidden, self.confidence)[:, 0]
        return Draft(chosen[1:], logits[:n], confidence)
