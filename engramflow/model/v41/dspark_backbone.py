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
from engramflow.kernels import sum_order
from engramflow.model.backbone_base import Segment, StageState
from engramflow.model.speculative import Draft
from engramflow.model.v41.dspark import DraftAsk, DSpark
from engramflow.model.v41.dspark_config import dspark_config
from engramflow.model.v41.model import V41Backbone
from engramflow.model.v41.weights import WeightReader


class DSparkV41Backbone(V41Backbone):
    def __init__(self, ckpt: Checkpoint, blocks: range, device: str | torch.device = "cpu",
                 first: bool | None = None, last: bool | None = None, numerics: str | None = None,
                 exact_rows: bool = False):
        super().__init__(ckpt, blocks, device, first, last, numerics)
        self.dcfg = dspark_config(ckpt.raw_config, self.v41)
        self.taps_at = tuple(layer for layer in self.dcfg.target_layers if layer in blocks)
        self.dspark = None
        if self.last:  # the draft block is embedded with the backbone's table, even where another stage embeds
            r = WeightReader(ckpt, self.v41, self.device)
            embed = self.embed if self.embed is not None else r.dense("embed.weight")
            self.dspark = DSpark(r, self.dcfg, embed, self.head)
        if self.dspark is not None:
            self.cache.specs.update(self.dspark.cache_specs())
        self.exact_rows = exact_rows
        for block in self.layers:
            block.attn = DecodeRowsAttention(block.attn, self)

    def rows_apart(self, segments) -> bool:
        """Official numerics, a verified block: its rows run as decode steps (see the module doc).
        Batched numerics need nothing of the kind: a row's lists are its position's already."""
        return (self.numerics == "official" and len(segments) == 1 and segments[0].verify
                and segments[0].n > 1)

    def _enter(self, segments, xs) -> StageState:
        state = super()._enter(segments, xs)
        incoming = [x.get("taps", {}) if isinstance(x, dict) else {} for x in xs]
        state.extra["taps"] = {layer: torch.cat([t[layer] for t in incoming]) for layer in incoming[0]} \
            if incoming and incoming[0] else {}
        for s, x in zip(segments, xs):
            if isinstance(x, dict) and "decode_rows" in x:  # a verified block: each row's top-k lists so far
                s.extra["step"]["decode_rows"] = x["decode_rows"]
        return state

    def _run_block(self, block: int, state: StageState, started_s: float, wait_ms: float) -> None:
        if block in self.taps_at:
            state.extra["taps"][block] = state.h.mean(dim=1)
        if not (self.exact_rows and self.rows_apart(state.segments)):
            super()._run_block(block, state, started_s, wait_ms)
            return
        e, layer, (s,) = state.extra, self.layers[block - self.blocks.start], state.segments
        rows = s.extra["step"].setdefault("decode_rows", [{} for _ in range(s.n)])
        outs = [layer(state.h[i:i + 1], e["pre"][i:i + 1], [row_segment(s, i, rows[i])]) for i in range(s.n)]
        state.h, e["pre"] = torch.cat([h for h, _ in outs]), torch.cat([p for _, p in outs])

    def _segment_hand_over(self, state: StageState, s: Segment, needs=None) -> dict:
        rows = s.extra["step"].get("decode_rows")
        if rows is None:
            out = super()._segment_hand_over(state, s)
        else:  # a verified block: the per-forward lists live per row; the cache rows cross as usual
            out = super()._segment_hand_over(state, s, dataclasses.replace(self.hand_over, topk=set(), candidates=False))
            keep = {"topk"} | ({"candidates"} if self.hand_over.candidates else set())
            out["decode_rows"] = [{k: v for k, v in row.items() if k in keep} for row in rows]
        out["taps"] = {layer: t[s.a:s.b] for layer, t in state.extra["taps"].items()}
        return out

    def _predict(self, state: StageState, outs) -> None:
        taps = state.extra["taps"]
        joined = torch.cat([taps[layer] for layer in self.dcfg.target_layers], dim=-1)
        for s in state.segments:
            self.dspark.ingest(joined[s.a:s.b], s.start, s.extra["buffers"])
        super()._predict(state, outs)

    def draft(self, session: str, token: int, start: int | None = None, choose=None, n: int | None = None) -> Draft:
        """Draft after `token` at position `start` (default: the session's length); only ring
        rows of positions < start are read, so rows of a rejected draft not yet truncated do not matter."""
        return self.draft_many([(session, token, start, choose, n)])[0]

    def draft_many(self, asks: list[tuple]) -> list[Draft]:
        """Drafts for several sessions, (session, token, start, choose, n) each, in one forward
        of the draft layers (dspark.DSpark.draft_many)."""
        checked = []
        for session, token, start, choose, n in asks:
            length = self.cache.length(session)
            start = length if start is None else start
            if not 0 < start <= length:
                raise EngramflowError(f"draft position {start} is outside (0, {length}] for session {session!r}")
            checked.append(DraftAsk(token, start, lambda name, s=session: self.cache.buffer(s, name), choose, n))
        with sum_order.use(self.numerics), torch.inference_mode():
            return self.dspark.draft_many(checked)


def row_segment(s: Segment, i: int, step: dict) -> Segment:
    """Row i of segment s as a one-row segment with its own per-forward state."""
    return Segment(s.session, 0, 1, s.start + i, extra={"buffers": s.extra["buffers"], "step": step})


class DecodeRowsAttention:
    """A layer's attention that, while the stage verifies in official numerics, runs each row as a
    decode step."""

    def __init__(self, inner, stage: DSparkV41Backbone):
        self.inner, self.stage = inner, stage

    def __call__(self, x: torch.Tensor, segments) -> torch.Tensor:
        if self.stage.exact_rows or not self.stage.rows_apart(segments):
            return self.inner(x, segments)
        (s,) = segments
        rows = s.extra["step"].setdefault("decode_rows", [{} for _ in range(s.n)])
        return torch.cat([self.inner(x[i:i + 1], [row_segment(s, i, rows[i])]) for i in range(s.n)])
