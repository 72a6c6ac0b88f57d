"""Run one step's requests through a backbone stage.

The Engram K/V of a step cover all its requests at once (one projection call per layer per
step); each request's forward takes its own rows. The K/V arrive through one resolver per
layer, called the first time any request reaches that layer, so the stage runs its earlier
blocks before it waits.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import torch

from engramflow.model.backbone_base import BackboneStage

KV = tuple[torch.Tensor, torch.Tensor]


@dataclasses.dataclass
class StageRequest:
    session: str
    start_pos: int
    n: int
    dead: np.ndarray | None = None


@dataclasses.dataclass
class StageBatchOutput:
    hs: list[torch.Tensor] | None  # per request h [T, hc, dim] (not the last stage)
    logits: list[torch.Tensor] | None  # per request, last position's fp32 logits (last stage)
    exposed_wait_ms: dict[int, float]
    spans: list


def to_device(x, device: str | torch.device = "cpu"):
    """A stage output (a tensor, or a dict/tuple/list of them: a V4.1 boundary) on `device`."""
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, dict):
        return {k: to_device(v, device) for k, v in x.items()}
    if isinstance(x, (tuple, list)):
        return type(x)(to_device(v, device) for v in x)
    return x


def run_stage_batch(stage: BackboneStage, reqs: list[StageRequest], xs: list[torch.Tensor],
                    engram_kv: dict[int, Callable[[], KV]]) -> StageBatchOutput:
    cache: dict[int, KV] = {}
    offsets = np.cumsum([0] + [r.n for r in reqs])

    def rows(layer: int, a: int, b: int) -> Callable[[], KV]:
        def resolve() -> KV:
            if layer not in cache:
                cache[layer] = engram_kv[layer]()
            key, value = cache[layer]
            return key[a:b], value[a:b]
        return resolve

    hs, logits, spans = [], [], []
    waits: dict[int, float] = {}
    for r, x, a, b in zip(reqs, xs, offsets, offsets[1:]):
        mask = None if r.dead is None else torch.from_numpy(np.asarray(r.dead, dtype=bool))
        resolvers = {layer: rows(layer, int(a), int(b)) for layer in stage.engram_layers}
        out = stage.forward(r.session, x, r.start_pos, resolvers, mask)
        for layer, ms in out.exposed_wait_ms.items():
            waits[layer] = waits.get(layer, 0.0) + ms
        spans.append((r.session, out.spans))
        if stage.last:
            logits.append(out.next_logits.float().cpu())
        else:
            hs.append(out.h)
    return StageBatchOutput(None if stage.last else hs, logits if stage.last else None, waits, spans)
