"""What a stage forward takes and gives: the step's inputs per session, each session's rows of
the step (a Segment), the state carried from block to block, and the outputs."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class BlockSpan:
    """One block of one forward. Wall-clock ns (time.time_ns) so spans from different
    processes line up on one timeline; on CUDA they are host-side (launch) times."""
    block: int
    start_ns: int
    end_ns: int
    wait_ms: float = 0.0  # time inside the Engram resolver at this block's entry


@dataclass
class Segment:
    """One session's rows in a forward: rows [a, b) of the step, at positions start.. of the session."""
    session: str
    a: int
    b: int
    start: int
    verify: bool = False  # last stage: logits of every row (a speculative block), not just the last
    extra: dict = field(default_factory=dict)  # the backbone's per-session state for this forward

    @property
    def n(self) -> int:
        return self.b - self.a

    @property
    def end(self) -> int:
        return self.start + self.n


@dataclass
class StepInput:
    """One session's part of a step: token ids (first stage) or the previous stage's output."""
    session: str
    x: torch.Tensor | dict
    start_pos: int
    mask: torch.Tensor | None = None  # bool [T]: image-span positions (Engram off; V4.1 routes them with bias_vl)
    images: list | None = None  # first stage: (offset, rows [n, dim]) written over the embeddings
    verify: bool = False


@dataclass
class StageState:
    """What a forward carries from block to block: the residual h of every row of the step, the
    sessions' segments, and the backbone's extras."""
    segments: list[Segment]
    h: torch.Tensor
    extra: dict = field(default_factory=dict)
    dead: torch.Tensor | None = None  # bool [rows]: image-span positions


@dataclass
class StageOutput:
    h: torch.Tensor | None = None       # [T, hc, dim] fp32, on the stage's device (not the last stage)
    logits: torch.Tensor | None = None  # last stage: [1, vocab] fp32 at the last position (emulated: proxy logits)
    tokens: torch.Tensor | None = None  # last stage: the greedy next token, int64 [1]
    next_logits: torch.Tensor | None = None  # last stage: fp32 [vocab] logits after the last position
    exposed_wait_ms: dict[int, float] = field(default_factory=dict)  # Engram layer id -> ms
    spans: list[BlockSpan] = field(default_factory=list)


@dataclass
class StepOutput:
    """A forward over several sessions: one StageOutput per input (h or logits), and the step's
    Engram waits and block spans (shared by its sessions)."""
    outputs: list[StageOutput]
    exposed_wait_ms: dict[int, float] = field(default_factory=dict)
    spans: list[BlockSpan] = field(default_factory=list)
