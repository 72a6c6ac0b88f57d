"""Pick a backbone by name for a range of blocks (`reference`, `emulated` or `v41`: docs/architecture.md, "Backbones")."""
from __future__ import annotations

import torch

from engramflow.errors import EngramflowError
from engramflow.kernels import sum_order
from engramflow.validate import check_int
from engramflow.model.backbone_base import BackboneStage
from engramflow.model.backbone_emulated import EmulatedBackbone
from engramflow.model.backbone_reference import ReferenceBackbone
from engramflow.io.checkpoint import Checkpoint

KINDS = ("reference", "emulated", "v41")


def check_dspark_backbone(kind: str) -> None:
    """Speculative decoding drafts with V4.1's own draft layers: only the v41 backbone has them."""
    if kind != "v41":
        raise EngramflowError(f"DSpark speculative decoding needs the v41 backbone, not {kind!r}")


def make_backbone(kind: str, ckpt: Checkpoint, blocks: range, device: str | torch.device = "cpu",
                  block_ms: float = 1.0, dspark: bool = False, numerics: str | None = None,
                  exact_rows: bool = False) -> BackboneStage:
    """`dspark`: a V4.1 stage that taps the draft layers' inputs, verifies blocks and (last
    stage) holds the DSpark draft layers (`exact_rows`: verified rows one by one, official
    numerics). `numerics`: "batched" or "official" (kernels/sum_order.py; None: the process
    default)."""
    cfg = ckpt.config
    if dspark:
        check_dspark_backbone(kind)
    if kind == "reference":
        if "embed.weight" not in ckpt.tensors and blocks.start == 0:
            raise EngramflowError(f"{ckpt.root} has no reference-backbone weights (make it with --preset tiny, "
                                  "or use the emulated backbone)")
        return ReferenceBackbone(cfg, ckpt.tensor, blocks, device, numerics=numerics)
    if kind == "v41":
        from engramflow.model.v41.model import V41Backbone  # the heavier model loads only when asked for

        if dspark:
            from engramflow.model.v41.dspark_backbone import DSparkV41Backbone

            return DSparkV41Backbone(ckpt, blocks, device, numerics=numerics, exact_rows=exact_rows)
        return V41Backbone(ckpt, blocks, device, numerics=numerics)
    if kind == "emulated":
        if not block_ms >= 0:
            raise EngramflowError(f"block_ms must be >= 0, got {block_ms!r}")
        return EmulatedBackbone(cfg, ckpt.tensor, blocks, block_ms, device=device, numerics=numerics)
    raise EngramflowError(f"unknown backbone {kind!r}; choose one of {', '.join(KINDS)}")


def split_blocks(n_layers: int, stages: int) -> list[range]:
    """Contiguous, near-equal block ranges, one per stage."""
    check_int("stages", stages, 1, n_layers)
    cuts = [round(i * n_layers / stages) for i in range(stages + 1)]
    return [range(a, b) for a, b in zip(cuts, cuts[1:])]


def projection_numerics(kind: str, numerics: str | None = None) -> str:
    """How the Engram projection computes K/V for this backbone in these numerics (see
    EngramProjection): batched numerics, every backbone: the exact block-scaled arithmetic with
    each row's bits its own (the fast path picks a GEMV or a tiled GEMM by the step's token
    count, so a session's K/V would depend on its company); official: the v41 backbone's
    official arithmetic, the fastest kernels for the others."""
    numerics = sum_order.resolve(numerics)
    return numerics if numerics == "batched" or kind == "v41" else "fast"


def stage_blocks(kind: str, ckpt: Checkpoint, stages: int) -> list[range]:
    """Block ranges for `stages` stages: contiguous and near-equal. A V4.1 cut may separate a
    source from its consumers: the boundary carries their shared state (model/v41/carry.py)."""
    return split_blocks(ckpt.config.n_layers, stages)

def default_backbone(checkpoint) -> str:
    """`v41` for a checkpoint whose config describes a V4.1 backbone, else `reference`."""
    from engramflow.io.config import load_raw
    from engramflow.model.v41.config import is_v41

    try:
        return "v41" if is_v41(load_raw(checkpoint)) else "reference"
    except EngramflowError:
        return "reference"  # the checkpoint's own loading reports what is wrong with it
