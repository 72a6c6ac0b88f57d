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

from engramflow.model.backbone_base import BackboneStage, StepInput
from engramflow.model.sampling import Pick, verifies

KV = tuple[torch.Tensor, torch.Tensor]


@dataclasses.dataclass
class StageRequest:
    session: str
    start_pos: int
    n: int
    dead: np.ndarray | None = None
    pick: Pick | None = None  # last stage: hand back this pick of the logits, not the logits
    images: tuple = ()  # ImageSlots (first stage): span rows over these positions' embeddings


@dataclasses.dataclass
class StageBatchOutput:
    hs: list[torch.Tensor] | None  # per request h [T, hc, dim] (not the last stage)
    logits: list | None  # per request, last position's fp32 logits, or its Picked (last stage)
    exposed_wait_ms: dict[int, float]
    spans: list


@dataclasses.dataclass(frozen=True)
class Bf16Array:
    """A bf16 tensor's bits as int16 numpy (numpy has no bf16), so it crosses Ray as a buffer."""
    bits: np.ndarray


def to_wire(x):
    """A stage output (tensor, or a dict/tuple/list of them) as numpy arrays: Ray ships numpy
    buffers out of band (zero-copy into the object store), where a torch tensor is pickled."""
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu()
        return Bf16Array(x.view(torch.int16).numpy()) if x.dtype == torch.bfloat16 else x.numpy()
    if isinstance(x, dict):
        return {k: to_wire(v) for k, v in x.items()}
    if isinstance(x, (tuple, list)):
        return type(x)(to_wire(v) for v in x)
    return x


def from_wire(x, device: str | torch.device = "cpu"):
    """The inverse of `to_wire`, on `device`. Arrays read from the object store are read-only;
    those are copied once (a stage may update its input in place)."""
    if isinstance(x, Bf16Array):
        return from_wire(x.bits, device).view(torch.bfloat16)
    if isinstance(x, np.ndarray):
        return torch.from_numpy(x if x.flags.writeable else x.copy()).to(device)
    if isinstance(x, dict):
        return {k: from_wire(v, device) for k, v in x.items()}
    if isinstance(x, (tuple, list)):
        return type(x)(from_wire(v, device) for v in x)
    return x


def run_stage_batch(stage: BackboneStage, reqs: list[StageRequest], xs: list[torch.Tensor],
                    engram_kv: dict[int, Callable[[], KV]], fetch: Callable = lambda rows: rows) -> StageBatchOutput:
    """One step through a stage. Batched numerics: one forward over every request's rows (each
    weight read once for the step). Official numerics: one forward per request, as the official
    code's shapes. `fetch` turns an ImageSlot's rows into a tensor (a Ray stage passes ray.get
    for object refs)."""
    cache: dict[int, KV] = {}

    def whole(layer: int) -> KV:
        if layer not in cache:
            cache[layer] = engram_kv[layer]()
        return cache[layer]

    def rows(layer: int, a: int, b: int) -> Callable[[], KV]:
        def resolve() -> KV:
            key, value = whole(layer)
            return key[a:b], value[a:b]
        return resolve

    inputs = [StepInput(r.session, x, r.start_pos,
                        None if r.dead is None else torch.from_numpy(np.asarray(r.dead, dtype=bool)),
                        [(s.start, fetch(s.rows)[s.skip:s.skip + s.n]) for s in r.images] if stage.first else None,
                        verifies(r.pick))
              for r, x in zip(reqs, xs)]
    if stage.numerics == "batched":
        steps = [(reqs, stage.forward_step(inputs, {layer: (lambda layer=layer: whole(layer))
                                                    for layer in stage.engram_layers}))]
    else:
        offsets = np.cumsum([0] + [r.n for r in reqs])
        steps = [([r], stage.forward_step([i], {layer: rows(layer, int(a), int(b)) for layer in stage.engram_layers}))
                 for r, i, a, b in zip(reqs, inputs, offsets, offsets[1:])]
    hs, logits, spans = [], [], []
    waits: dict[int, float] = {}
    for group, out in steps:
        for layer, ms in out.exposed_wait_ms.items():
            waits[layer] = waits.get(layer, 0.0) + ms
        spans.append((",".join(r.session for r in group), out.spans))
        for r, o in zip(group, out.outputs):
            if stage.last:
                last = o.next_logits.float().cpu()
                # a row of the step's logits is a view of all of them: pickled, a view carries its
                # whole storage, so each session would ship (and a caller keep) every session's row
                logits.append(r.pick(last) if r.pick is not None else last.clone())
            else:
                hs.append(o.h)
    return StageBatchOutput(None if stage.last else hs, logits if stage.last else None, waits, spans)
