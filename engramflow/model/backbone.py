"""Pluggable backbones (DESIGN §3), one import point.

* `reference`: a small causal decoder with hc residual streams and real weights
  (`backbone_reference.py`); `reference_weights` makes its deterministic random checkpoint.
* `emulated`: no weights, each block takes a fixed time, Engram gating stays real
  (`backbone_emulated.py`).

Both share the stage contract in `backbone_base.py`: per-session KV state (open, fork, reset,
close, truncate) and `forward(session, x, start_pos, engram_kv, engram_mask) -> StageOutput`,
where each Engram layer's K/V comes from a resolver called only when its block is reached.
"""
from engramflow.model.backbone_base import BackboneStage, BlockSpan, EngramResolver, StageOutput
from engramflow.model.backbone_emulated import EmulatedBackbone
from engramflow.model.backbone_reference import ReferenceBackbone, reference_weights

__all__ = ["BackboneStage", "BlockSpan", "EmulatedBackbone", "EngramResolver", "ReferenceBackbone",
           "StageOutput", "reference_weights"]
