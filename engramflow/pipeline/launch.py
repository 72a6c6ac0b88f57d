"""Starting a Pipeline: checks on the driver first, then every actor, then the placement.

Everything a user can get wrong (the checkpoint, its token map, the tiers, the options) is
checked before Ray starts, so a bad call costs no actor. The actors are made from `Slot`s
that recovery can call again to replace one that died.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import ray
from ray.exceptions import GetTimeoutError, RayError

from engramflow.actors.history_actor import TokenizerHistoryActor
from engramflow.actors.projection_actor import EngramProjectionActor
from engramflow.actors.stage_actor import BackboneStageActor
from engramflow.errors import EngramflowError
from engramflow.io.checkpoint import Checkpoint
from engramflow.memory.history import SessionHistory
from engramflow.model.backbones import check_dspark_backbone, default_backbone, projection_numerics, stage_blocks
from engramflow.model.vision import vision_config
from engramflow.pipeline import actor_pool, placement
from engramflow.pipeline.config import PipelineConfig, check_known
from engramflow.pipeline.faults import one_line, user_error
from engramflow.pipeline.placement_calibration import make_placement
from engramflow.pipeline.ray_address import ensure_ray
from engramflow.pipeline.speculative import check_draft_tokens, draft_block_size
from engramflow.tiers.config import parse_tiers

START_TIMEOUT_S = 300.0  # actors that cannot be placed in this time: the cluster lacks what they request


@dataclasses.dataclass
class Slot:
    """One actor of the pipeline and how to make it again."""
    role: str  # "history", "projection" or "stage"
    make: Callable[[], object]
    actor: object = None
    stateful: bool = True  # holds per-session state that replay must rebuild


def release(actors: list, groups) -> None:
    """End the actors (or keep them for the driver's next launch), then remove the placement
    groups that reserved what they used."""
    actor_pool.release(actors)  # ends them, unless the driver keeps idle actors for its next launch
    for pg in groups:
        if pg is not None:
            ray.util.remove_placement_group(pg)


def launch(cls, config: PipelineConfig | str | Path, *, owner=None, **options):
    """Pipeline.launch: start the actors of `config` (a PipelineConfig; or a checkpoint and the
    keywords PipelineConfig.build takes: `Pipeline.launch("ckpt", stages=2)`).
    `owner(slot name, make) -> make`: wraps how each actor is made (now and by recovery), so that
    another process can make and own them and they outlive this one (serve/keeper.py)."""
    if isinstance(config, PipelineConfig):
        check_known(options)  # a config is complete: variants come from dataclasses.replace
    else:
        config = PipelineConfig.build(config, **options)
    e, stages = config.engine, config.stages
    spec, checkpoint = e.spec, Path(e.checkpoint)
    draft_tokens = check_draft_tokens(spec.k, draft_block_size(checkpoint)) if spec is not None else None
    # validate on the driver first (checkpoint and token map): clear errors, no actors
    ckpt_obj = Checkpoint(checkpoint)
    SessionHistory.from_checkpoint(ckpt_obj)
    backbone = e.backbone or default_backbone(checkpoint)  # v41 for a V4.1 checkpoint
    # tiers checked here, before any actor: files only when they are local to the driver
    cfg = ckpt_obj.config
    vision = vision_config(ckpt_obj)  # the first stage runs the tower when it has one
    tiers = parse_tiers(e.tiers, cfg.engram_layer_ids, check_files=config.address is None) if e.tiers else None
    ckpt_obj.close()
    if spec is not None:
        check_dspark_backbone(backbone)  # on the driver: no actor starts to fail
    blocks = stage_blocks(ckpt_obj, stages)
    in_flight = stages if config.in_flight is None else config.in_flight
    ensure_ray(config.address)
    plan = placement.plan(list(cfg.engram_layer_ids), stages)

    def reserve():  # the projection actors' resources, before any actor: a cluster without them costs none
        return placement.reserve(plan, START_TIMEOUT_S)

    slots, layer_slot = _slots(str(checkpoint), plan, blocks, backbone, config, tiers)
    if owner is not None:
        reserve = owner("reservation", reserve)
        for name, slot in slots.items():
            slot.make = owner(name, slot.make)
    groups = (plan.placement_group, _reserved(reserve, plan))
    _start(slots, plan, groups)
    try:
        chosen = make_placement(config.projection, cfg, [s.actor for s in slots.values() if s.role == "projection"],
                                [s.actor for s in slots.values() if s.role == "stage"], config.placement_rates)
    except BaseException:
        release([s.actor for s in slots.values()], groups)
        raise
    pipe = cls(checkpoint, cfg, slots, layer_slot, blocks, e.prefill_chunk, config.policy,
               placement=chosen, backbone=backbone, in_flight=in_flight, placement_groups=groups,
               vision_cfg=vision if vision.enabled else None, numerics=e.numerics, speculative=draft_tokens,
               speculative_gate=spec.threshold if spec is not None else None)
    pipe.config = config
    return pipe


def _slots(ckpt: str, plan, blocks, backbone: str, config: PipelineConfig, tiers):
    """The history actor on the driver's node, the projection groups and the stages of `plan`.
    The actors get plain values: they import nothing of pipeline/ (tests/test_layering.py)."""
    e, emulation = config.engine, config.engine.emulation
    numerics, spec, stage_projection = e.numerics, e.spec, config.projection != "host"
    driver = ray.get_runtime_context().get_node_id()
    slots = {"history": Slot("history", lambda: actor_pool.make(
        TokenizerHistoryActor, {"num_cpus": 0} | placement.on_node(driver), ckpt))}
    layer_slot = {}
    for k, (layers, cpus) in enumerate(plan.projection_groups):
        opts = {"max_concurrency": len(layers) + 2} | plan.projection_options(k)
        slots[f"projection{k}"] = Slot("projection", lambda o=opts, l=layers, c=cpus: actor_pool.make(
            EngramProjectionActor, o, ckpt, l, c, config.warmup, emulation.projection_delay_ms, tiers,
            projection_numerics(backbone, numerics), e.threads), stateful=False)
        layer_slot |= {layer: f"projection{k}" for layer in layers}
    for g, (b, opts) in enumerate(zip(blocks, plan.stage_options)):
        slots[f"stage{g}"] = Slot("stage", lambda o=opts, b=b: actor_pool.make(
            BackboneStageActor, o, ckpt, (b.start, b.stop), backbone, emulation.block_ms, stage_projection, spec,
            numerics, e.threads))
    return slots, layer_slot


def _reserved(reserve, plan):
    """reserve(), or a one-line error with the stages' GPU group removed."""
    try:
        return reserve()
    except BaseException as e:
        release([], [plan.placement_group])
        if isinstance(e, RayError):  # made by an owner (serve/keeper.py): its error comes wrapped
            raise user_error(e) or EngramflowError(f"could not reserve the projection actors' resources: "
                                                   f"{one_line(e)}") from None
        raise


def _start(slots: dict[str, Slot], plan, groups) -> None:
    """Make every actor and surface constructor errors now, not at the first step."""
    try:
        for slot in slots.values():
            slot.actor = slot.make()
        errors = ray.get([slot.actor.init_error.remote() for slot in slots.values()], timeout=START_TIMEOUT_S)
    except (RayError, GetTimeoutError) as e:
        release([s.actor for s in slots.values() if s.actor is not None], groups)
        if isinstance(e, GetTimeoutError):
            raise EngramflowError(f"the pipeline's actors did not start within {START_TIMEOUT_S:.0f} s: the "
                                  f"cluster lacks the resources they request ({plan.describe()})") from None
        raise user_error(e) or EngramflowError(f"the pipeline's actors failed to start: {one_line(e)}") from None
    if any(errors):
        release([s.actor for s in slots.values()], groups)
        raise EngramflowError(next(err for err in errors if err))
