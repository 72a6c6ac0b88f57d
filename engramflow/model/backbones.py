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


def stage_blocks(ckpt: Checkpoint, stages: int) -> list[range]:
    """Block ranges for `stages` stages: contiguous and near-equal. A V4.1 cut may separate a
    source from its consumers: the boundary carries their shared state (model/v41/carry.py)."""
    return split_blocks(ckpt.config.n_layers, stages)

def backbone_of(raw_config: dict) -> str:
    """`v41` for a config that describes a V4.1 backbone, else `reference`."""
    from engramflow.model.v41.config import is_v41

    return "v41" if is_v41(raw_config) else "reference"


def default_backbone(checkpoint) -> str:
    """`backbone_of` the checkpoint's config.json (`reference` when it cannot be read)."""
    from engramflow.io.config import load_raw

    try:
        return backbone_of(load_raw(checkpoint))
    except EngramflowError:
        return "reference"  # the checkpoint's own loading reports what is wrong with it


def check_backbone_names(ckpt: Checkpoint) -> dict | None:
    """For a V4.1 checkpoint, the whole tensor name set its config implies, every dtype and shape,
    from the headers alone: the first wrong tensor is refused, else a compact summary comes back.
    None for the other backbones (toy-sized or weightless: nothing to check by name)."""
    if backbone_of(ckpt.raw_config) != "v41":
        return None
    from engramflow.model.v41.model import load_v41_config
    from engramflow.model.v41.validate import validate_v41

    summary = validate_v41(ckpt, ckpt.raw_config)
    load_v41_config(ckpt)  # and the Engram layers agree with the Engram config
    return summary
