"""What a V4.1 stage boundary carries besides the residual (stages may cut anywhere).

Layers read state their sources made: a consumer reads its KV source's compressed rows and its
index source's top-k; an index source reads its key source's index keys and, after the
candidate source, its candidate mask. When a cut separates a source from a reader, the stage
before the cut hands over, per forward:
  * the rows of those caches written in this forward (compressed KV, index keys) — the stage
    after the cut keeps them in mirror buffers of its own session cache, so rollback, fork and
    replay treat them like every other cache;
  * this forward's top-k lists and candidate mask (per-forward state, never cached).
A middle stage forwards what it received when a later stage needs it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engramflow.model.v41.cache import BufferSpec
from engramflow.model.v41.config import V41Config


@dataclass
class CutNeeds:
    rows: dict[str, int] = field(default_factory=dict)  # cache buffer name -> ratio
    topk: set[int] = field(default_factory=set)         # index sources whose lists cross the cut
    candidates: bool = False


def needs_across(cfg: V41Config, cut: int) -> CutNeeds:
    """What layers at or after `cut` read from layers before it."""
    out = CutNeeds()
    for role in cfg.roles[cut:]:
        if role.ratio == 0:
            continue
        if role.kv_source < cut:
            out.rows[f"compressed.{role.kv_source}"] = role.ratio
        if role.indexes:
            if role.key_source < cut:
                out.rows[f"index_keys.{role.key_source}"] = role.ratio
            out.candidates |= role.uses_candidates and cfg.candidate_source_layer < cut
        elif role.index_source < cut:
            out.topk.add(role.index_source)
    return out


def mirror_specs(cfg: V41Config, blocks: range) -> dict[str, BufferSpec]:
    """Cache buffers a stage keeps for sources on earlier stages."""
    return {name: BufferSpec(ratio, cfg.index_head_dim if name.startswith("index_keys") else cfg.head_dim,
                             torch.bfloat16)
            for name, ratio in needs_across(cfg, blocks.start).rows.items()}


def export(needs: CutNeeds, buffers, step: dict, start: int, end: int) -> dict:
    """The shared state this forward hands to the next stage."""
    rows = {}
    for name, ratio in needs.rows.items():
        g0, g1 = start // ratio, end // ratio
        rows[name] = (g0, buffers(name)[g0:g1])
    carried = {"topk": {layer: step["topk"][layer] for layer in needs.topk}}
    if needs.candidates and "candidates" in step:
        carried["candidates"] = step["candidates"]
    return {"rows": rows, "step": carried}


def receive(boundary: dict, buffers, device: torch.device) -> dict:
    """Write the received cache rows into the mirrors; returns the per-forward state."""
    for name, (g0, rows) in boundary.get("rows", {}).items():
        buffers(name)[g0:g0 + rows.shape[0]] = rows
    step = boundary.get("step", {})
    out = {"topk": {layer: idx.to(device) for layer, idx in step.get("topk", {}).items()}}
    if "candidates" in step:
        out["candidates"] = step["candidates"].to(device)
    return out
