"""A V4.1 stage that can verify a draft block and holds the DSpark draft layers (last stage).

Compared with the plain stage:
* it taps the input h of the DSpark target layers it owns (hc copies averaged) and passes the
  taps on across a stage boundary, so the last stage has them for every position;
* the last stage feeds every forward's taps to the draft layers (their ring rows are cache
  buffers of the session, so rollback, fork and replay treat them like every other cache);
* with `verify` set, the last stage returns the logits of every position of the forward
  ([T, vocab] in `next_logits`), not just the last one: a draft block is checked in one forward.

Verification computes each row as the decode step at its position would. V4.1's attention list
of a query depends on where its forward ends (a prefill chunk gives every query min(window, end)
window slots and min(top-k, end // ratio) compressed rows, −1 where not yet visible, and the
online softmax runs over the list in blocks), so a row of a chunk is not bit for bit the decode
step at its position while the window or top-k is not yet full. In verify mode the attention
core therefore runs row by row with each row's own end; everything else (the linears, the MoE)
takes the rows together. That is exact where those ops are batch-invariant; on CPU the dense
(bf16/fp32) linears are not (a GEMM over T rows may sum in another order than the decode step's
GEMV), which moves a row's last bits now and then. With `exact_rows`, every block runs row by row
instead (still one forward per stage, one Engram lookup, one message): every op then sees what
the decode step at that row's position sees, so greedy speculative output is plain greedy
decoding's token for token, at the cost of the batching.
"""
from __future__ import annotations

import dataclasses

import torch

from engramflow.errors import EngramflowError
from engramflow.io.checkpoint import Checkpoint
from engramflow.model.backbone_base import StageOutput, StageState
from engramflow.model.v41.dspark import Draft, DSpark
from engramflow.model.v41.carry import export
from engramflow.model.v41.dspark_config import dspark_config
from engramflow.model.v41.hc import collapse
from engramflow.model.v41.model import V41Backbone
from engramflow.model.v41.ops import rms_norm
from engramflow.model.v41.weights import WeightReader


class DSparkV41Backbone(V41Backbone):
    def __init__(self, ckpt: Checkpoint, blocks: range, device: str | torch.device = "cpu",
                 first: bool | None = None, last: bool | None = None):
        super().__init__(ckpt, blocks, device, first, last)
        self.dcfg = dspark_config(ckpt.raw_config, self.v41)
        self.taps_at = tuple(layer for layer in self.dcfg.target_layers if layer in blocks)
        self.dspark = None
        if self.last:  # the draft block is embedded with the backbone's table, even where another stage embeds
            r = WeightReader(ckpt, self.v41, self.device)
            embed = self.embed if self.embed is not None else r.dense("embed.weight")
            self.dspark = DSpark(r, self.dcfg, embed, self.head)
        if self.dspark is not None:
            self.cache.specs.update(self.dspark.cache_specs())
        self.verify = False
        self.exact_rows = False
        for block in self.layers:
            block.attn = DecodeRowsAttention(block.attn, self)

    def _enter(self, session: str, x, start_pos: int) -> StageState:
        state = super()._enter(session, x, start_pos)
        state.extra["taps"] = dict(x.get("taps", {})) if isinstance(x, dict) else {}
        if isinstance(x, dict) and "decode_rows" in x:  # a verified block: each row's top-k lists so far
            state.extra["step"]["decode_rows"] = x["decode_rows"]
        return state

    def _run_block(self, block: int, state: StageState, started_s: float, wait_ms: float) -> None:
        if block in self.taps_at:
            state.extra["taps"][block] = state.h.mean(dim=1)
        if not (self.verify and self.exact_rows) or state.h.shape[0] == 1:
            super()._run_block(block, state, started_s, wait_ms)
            return
        e, layer = state.extra, self.layers[block - self.blocks.start]
        rows = e["step"].setdefault("decode_rows", [{} for _ in range(state.h.shape[0])])
        outs = [layer(state.h[i:i + 1], e["pre"][i:i + 1], state.start_pos + i, e["buffers"], rows[i])
                for i in range(state.h.shape[0])]
        state.h, e["pre"] = torch.cat([h for h, _ in outs]), torch.cat([p for _, p in outs])

    def _hand_over(self, state: StageState) -> dict:
        e = state.extra
        rows = e["step"].get("decode_rows")
        if rows is None:
            return super()._hand_over(state) | {"taps": e["taps"]}
        # a verified block: the per-forward lists live per row; the cache rows cross as usual
        needs = dataclasses.replace(self.hand_over, topk=set(), candidates=False)
        out = {"h": state.h.float(), "pre": e["pre"], "taps": e["taps"]}
        out |= export(needs, e["buffers"], e["step"], state.start_pos, state.start_pos + state.h.shape[0])
        keep = {"topk"} | ({"candidates"} if self.hand_over.candidates else set())
        out["decode_rows"] = [{k: v for k, v in row.items() if k in keep} for row in rows]
        return out

    def _predict(self, state: StageState, out: StageOutput) -> None:
        taps = state.extra["taps"]
        self.dspark.ingest(torch.cat([taps[layer] for layer in self.dcfg.target_layers], dim=-1),
                           state.start_pos, state.extra["buffers"])
        if not self.verify:
            super()._predict(state, out)
            return
        y = rms_norm(collapse(state.h, state.extra["pre"]), self.norm, self.v41.norm_eps).float()
        # one GEMV per row, as a decode step computes its logits (a GEMM may sum in another order)
        out.next_logits = torch.stack([torch.nn.functional.linear(row, self.head) for row in y])
        out.logits = out.next_logits
        out.tokens = out.next_logits[-1].argmax().view(1)

    def draft(self, session: str, token: int, start: int | None = None, choose=None, n: int | None = None) -> Draft:
        """Draft after `token` at position `start` (default: the session's length); only ring
        rows of positions < start are read, so rows of a rejected draft not yet truncated do not matter."""
        start = self.cache.length(session) if start is None else start
        if not 0 < start <= self.cache.length(session):
            raise EngramflowError(f"draft position {start} is outside (0, {self.cache.length(session)}] "
                                  f"for session {session!r}")
        return self.dspark.draft(token, start, lambda name: self.cache.buffer(session, name), choose, n)


class DecodeRowsAttention:
    """A layer's attention that, while the stage verifies, runs each row as a decode step."""

    def __init__(self, inner, stage: DSparkV41Backbone):
        self.inner, self.stage = inner, stage

    def __call__(self, x: torch.Tensor, start: int, buffers, step: dict) -> torch.Tensor:
        if not self.stage.verify or self.stage.exact_rows or x.shape[0] == 1:
            return self.inner(x, start, buffers, step)
        rows = step.setdefault("decode_rows", [{} for _ in range(x.shape[0])])
        return torch.cat([self.inner(x[i:i + 1], start + i, buffers, rows[i]) for i in range(x.shape[0])])
