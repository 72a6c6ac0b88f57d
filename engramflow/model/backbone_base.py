"""What every backbone stage shares: sessions, input checks, and the Engram wait.

A stage owns a contiguous range of blocks. Its forward takes token ids (first stage) or the
hidden state h [T, hc, dim] (later stages) and returns a `StageOutput`. Engram K/V arrive as
zero-argument resolvers, one per Engram layer id; a resolver is called only when the forward
reaches that layer's block, so the blocks before it run while the projection is still being
computed elsewhere (a Ray stage passes `lambda: ray.get(ref)`). The time spent inside the
resolver is the exposed wait: the part of the Engram work the backbone could not hide.
"""
from __future__ import annotations

import time
import zlib
from collections.abc import Callable, Mapping

import torch

from engramflow.errors import EngramflowError
from engramflow.io.config import ModelConfig
from engramflow.kernels import sum_order
from engramflow.model.stage_io import (BlockSpan, Segment, StageOutput, StageState,  # noqa: F401 (re-exported)
                                       StepInput, StepOutput)
from engramflow.model.kv_cache import KVCache

# () -> (key [T, hc, dim], value [T, dim]); may block until the projection is ready
EngramResolver = Callable[[], tuple[torch.Tensor, torch.Tensor]]


def _check_blocks(cfg: ModelConfig, blocks: range) -> range:
    if not isinstance(blocks, range) or blocks.step != 1 or not 0 <= blocks.start <= blocks.stop <= cfg.n_layers:
        raise EngramflowError(f"blocks must be a range [a, b) with 0 <= a <= b <= n_layers={cfg.n_layers}, got {blocks!r}")
    return blocks


class BackboneStage:
    """Session bookkeeping and the checks/helpers both backbones' forward loops use."""

    def __init__(self, cfg: ModelConfig, blocks: range, first: bool | None, last: bool | None,
                 cache: KVCache, device: str | torch.device, numerics: str | None = None):
        self.cfg = cfg
        self.numerics = sum_order.resolve(numerics)
        self.blocks = _check_blocks(cfg, blocks)
        # default: the stage holding block 0 embeds, the one holding the final block predicts
        self.first = blocks.start == 0 if first is None else bool(first)
        self.last = blocks.stop == cfg.n_layers if last is None else bool(last)
        self.engram_layers = tuple(layer for layer in cfg.engram_layer_ids if layer in blocks)
        self.cache = cache
        self.device = torch.device(device)
        self.gates: dict = {}  # Engram layer -> gate, filled by the backbone

    # -- sessions ----------------------------------------------------------------------------

    def open(self, session: str) -> None:
        self.cache.open(session)

    def close(self, session: str) -> None:
        self.cache.close(session)

    def reset(self, session: str) -> None:
        self.cache.reset(session)

    def fork(self, src: str, dst: str) -> None:
        self.cache.fork(src, dst)

    def truncate(self, session: str, length: int) -> None:
        self.cache.truncate(session, length)

    def cached_len(self, session: str) -> int:
        return self.cache.length(session)

    def live_sessions(self) -> int:
        return self.cache.live_sessions()

    def cached_positions(self) -> int:
        return self.cache.cached_positions()

    # -- the forward: one loop for every backbone ----------------------------------------------

    def forward(self, session: str, x: torch.Tensor | dict, start_pos: int,
                engram_kv: Mapping[int, EngramResolver] | None = None,
                engram_mask: torch.Tensor | None = None, images: list | None = None) -> StageOutput:
        """One session's positions [start_pos, start_pos + T): `forward_step` with one input."""
        step = self.forward_step([StepInput(session, x, start_pos, engram_mask, images)], engram_kv)
        out = step.outputs[0]
        out.exposed_wait_ms, out.spans = step.exposed_wait_ms, step.spans
        return out

    @torch.inference_mode()
    def forward_step(self, inputs: list[StepInput],
                     engram_kv: Mapping[int, EngramResolver] | None = None) -> StepOutput:
        """Run this stage's blocks once over the rows of every input (each a session's positions
        [start_pos, start_pos + T)), in this stage's numerics. Each Engram layer's resolver gives
        the K/V of all the step's rows, in input order; it is called (and its wait timed) when its
        block is reached. Each input's `images` (first stage) are (offset, rows [n, dim]) pairs
        written over its embeddings. Every input is checked before any session changes."""
        with sum_order.use(self.numerics):
            checked = [self._check(i.session, i.x, i.start_pos, engram_kv, i.mask) for i in inputs]
            names = [i.session for i in inputs]
            if len(set(names)) != len(names):
                raise EngramflowError(f"a step holds each session once, got {names}")
            segments, row = [], 0
            for i, (x, _) in zip(inputs, checked):
                n = x["h"].shape[0] if isinstance(x, dict) else x.shape[0]
                self._make_room(i.session, i.start_pos, n)
                segments.append(Segment(i.session, row, row + n, i.start_pos, i.verify))
                row += n
            state = self._enter(segments, [x for x, _ in checked])
            state.dead = _joined_mask([m for _, m in checked], segments, self.device)
            images = [(s.a + offset, rows) for i, s in zip(inputs, segments) for offset, rows in (i.images or ())]
            if images:
                self._merge_images(state, images)
            out = StepOutput([StageOutput() for _ in inputs])
            for block in self.blocks:
                start_ns, started_s, wait_ms = time.time_ns(), time.perf_counter(), 0.0
                if block in self.gates:
                    state.h, wait_ms = self._apply_engram(self.gates[block], block, state, engram_kv[block], out)
                self._run_block(block, state, started_s, wait_ms)
                out.spans.append(BlockSpan(block, start_ns, time.time_ns(), wait_ms))
            for s in segments:
                self.cache.commit(s.session, s.end)
            if self.last:
                self._predict(state, out.outputs)
            else:
                for o, h in zip(out.outputs, self._hand_over(state)):
                    o.h = h
            return out

    # what each backbone fills in
    def _enter(self, segments: list[Segment], xs: list) -> StageState:
        """The state entering the first block, over every segment's rows: embedded ids (first
        stage) or the boundaries."""
        raise NotImplementedError

    def _run_block(self, block: int, state: StageState, started_s: float, wait_ms: float) -> None:
        raise NotImplementedError

    def _predict(self, state: StageState, outs: list[StageOutput]) -> None:
        """Last stage, per segment: out.logits [1, vocab], out.tokens [1] and out.next_logits
        [vocab] (a verifying segment: every row's, [T, vocab])."""
        raise NotImplementedError

    def _merge_images(self, state: StageState, images: list) -> None:
        raise EngramflowError(f"the {type(self).__name__} backbone takes no images")

    def _hand_over(self, state: StageState) -> list:
        """What the next stage receives per segment (h, or a dict holding h)."""
        return [state.h[s.a:s.b] for s in state.segments]

    # -- forward helpers ---------------------------------------------------------------------

    def _check(self, session: str, x: torch.Tensor | dict, start_pos: int,
               engram_kv: Mapping[int, EngramResolver] | None,
               engram_mask: torch.Tensor | None) -> tuple[torch.Tensor | dict, torch.Tensor | None]:
        """Check one input; changes nothing. Returns the stage input on the device (fp32 h, or
        int64 ids) and the mask on the device. A later stage's input may be a dict holding h under
        "h" (and whatever else the backbone carries across stages); it comes back as the same
        dict with h checked and moved.

        If the forward fails later (a resolver raising, say), its sessions stay truncated at
        their start_pos: the positions they would have rewritten are gone, every earlier one is
        intact.
        """
        cached = self.cache.length(session)  # raises for an unknown session
        if isinstance(start_pos, bool) or not isinstance(start_pos, int) or not 0 <= start_pos <= cached:
            raise EngramflowError(
                f"start_pos={start_pos!r} is outside session {session!r}, which holds {cached} positions")
        boundary = x if isinstance(x, dict) and not self.first else None
        if boundary is not None:  # a stage boundary with more than h (v41: collapse weights, shared state)
            x = boundary.get("h")
        if not isinstance(x, torch.Tensor):
            raise EngramflowError(f"stage input must be a torch.Tensor, got {type(x).__name__}")
        if self.first:
            if x.dim() != 1 or x.dtype.is_floating_point or x.dtype == torch.bool or x.numel() == 0:
                raise EngramflowError(
                    f"first stage expects token ids as a non-empty 1-D integer tensor, got {x.dtype} {tuple(x.shape)}")
            lo, hi = int(x.min()), int(x.max())
            if lo < 0 or hi >= self.cfg.vocab_size:
                bad = lo if lo < 0 else hi
                raise EngramflowError(f"token id {bad} is outside the vocabulary [0, {self.cfg.vocab_size})")
            x = x.to(self.device, torch.int64)
        else:
            want = (self.cfg.hc_mult, self.cfg.dim)
            if x.dim() != 3 or tuple(x.shape[1:]) != want or x.shape[0] == 0 or not x.dtype.is_floating_point:
                raise EngramflowError(
                    f"stage starting at block {self.blocks.start} expects h [T, {want[0]}, {want[1]}] float, "
                    f"got {x.dtype} {tuple(x.shape)}")
            x = x.to(self.device, torch.float32)
        n = x.shape[0]
        if start_pos + n > self.cache.max_len:
            raise EngramflowError(
                f"session {session!r} would reach {start_pos + n} positions, above max_seq_len={self.cache.max_len}")
        missing = [layer for layer in self.engram_layers if engram_kv is None or layer not in engram_kv]
        if missing:
            raise EngramflowError(f"no Engram K/V resolver for layer(s) {missing} owned by this stage")
        if engram_mask is not None:
            if not isinstance(engram_mask, torch.Tensor) or engram_mask.dtype != torch.bool or tuple(engram_mask.shape) != (n,):
                got = f"{engram_mask.dtype} {tuple(engram_mask.shape)}" if isinstance(engram_mask, torch.Tensor) else type(engram_mask).__name__
                raise EngramflowError(f"engram_mask must be a bool tensor of shape ({n},), got {got}")
            engram_mask = engram_mask.to(self.device)
        if boundary is not None:
            x = boundary | {"h": x}
        return x, engram_mask

    def _make_room(self, session: str, start_pos: int, n: int) -> None:
        """Roll the session back to start_pos and make room for n more positions."""
        if start_pos < self.cache.length(session):
            self.cache.truncate(session, start_pos)
        self.cache.reserve(session, start_pos + n)

    def _resolve(self, layer: int, resolver: EngramResolver, n: int) -> tuple[torch.Tensor, torch.Tensor, float]:
        """Call the resolver (timing the wait), check shapes, move K/V to the device as fp32."""
        t0 = time.perf_counter()
        key, value = resolver()
        wait_ms = (time.perf_counter() - t0) * 1e3
        hc, dim = self.cfg.hc_mult, self.cfg.dim
        if tuple(key.shape) != (n, hc, dim) or tuple(value.shape) != (n, dim):
            raise EngramflowError(
                f"Engram layer {layer}: expected key [{n}, {hc}, {dim}] and value [{n}, {dim}], "
                f"got {tuple(key.shape)} and {tuple(value.shape)}")
        key = key.to(self.device).float()
        value = value.to(self.device).float()
        return key, value, wait_ms

    def _apply_engram(self, gate, layer: int, state: StageState, resolver: EngramResolver,
                      out: StepOutput) -> tuple[torch.Tensor, float]:
        """Gate this layer's Engram value into every row's h at block entry; returns (h, wait_ms)."""
        key, value, wait_ms = self._resolve(layer, resolver, state.h.shape[0])
        out.exposed_wait_ms[layer] = wait_ms
        return gate(state.h, key, value, state.dead), wait_ms


def _joined_mask(masks: list, segments: list[Segment], device) -> torch.Tensor | None:
    """The step's image mask over all its rows (None when no input has one)."""
    if all(m is None for m in masks):
        return None
    return torch.cat([m if m is not None else torch.zeros(s.n, dtype=torch.bool, device=device)
                      for m, s in zip(masks, segments)])


def rmsnorm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return x if weight is None else x * weight


def seeded_generator(seed: int, name: str) -> torch.Generator:
    """One generator per (seed, name): adding a tensor never shifts the others' values."""
    return torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
