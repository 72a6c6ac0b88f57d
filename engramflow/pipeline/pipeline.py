"""The Ray pipeline (DESIGN §3): history actor -> projection actors -> stage actor chain.

Each step the driver submits everything before it waits: the history append (addresses as
an ObjectRef), one projection per Engram layer on that ref, and the whole stage chain, each
stage taking the previous one's output ref and the K/V refs of its Engram layers nested, so a
stage starts its early blocks at once and blocks only on reaching an Engram layer.
"""
from __future__ import annotations

import os
from pathlib import Path

import ray

from engramflow.actors.history_actor import TokenizerHistoryActor
from engramflow.actors.projection_actor import EngramProjectionActor
from engramflow.actors.stage_actor import BackboneStageActor
from engramflow.errors import EngramflowError
from engramflow.model.backbones import KINDS, split_blocks
from engramflow.model.checkpoint import Checkpoint
from engramflow.pipeline import placement
from engramflow.pipeline.runner import Request, Runner, StepResult
from engramflow.pipeline.stage_batch import StageRequest


def ensure_ray(address: str | None) -> None:
    if ray.is_initialized():
        return
    if address is None:
        ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False,
                 configure_logging=False)
    else:
        ray.init(address=address, log_to_driver=False)


class Pipeline(Runner):
    def __init__(self, checkpoint: Path, cfg, history, projections: dict, stages: list, blocks: list[range],
                 prefill_chunk: int):
        super().__init__()
        self.checkpoint, self.cfg = checkpoint, cfg
        self.history_actor = history
        self.projection_for = projections  # layer id -> actor
        self.stage_actors = stages
        self.blocks = blocks
        self.prefill_chunk = prefill_chunk

    @classmethod
    def launch(cls, checkpoint: str | Path, stages: int = 1, address: str | None = None,
               backbone: str = "reference", block_ms: float = 1.0, prefill_chunk: int = 512,
               warmup: bool = False, projection_delay_ms: dict[int, float] | None = None) -> "Pipeline":
        checkpoint = Path(checkpoint).resolve()
        cfg = Checkpoint(checkpoint).config  # validate on the driver first: clear errors, no actors
        if backbone not in KINDS:
            raise EngramflowError(f"unknown backbone {backbone!r}; choose one of {', '.join(KINDS)}")
        blocks = split_blocks(cfg.n_layers, stages)
        ensure_ray(address)
        plan = placement.plan(list(cfg.engram_layer_ids), stages)
        ckpt = str(checkpoint)
        driver = ray.get_runtime_context().get_node_id()
        history = TokenizerHistoryActor.options(num_cpus=0, **placement.on_node(driver)).remote(ckpt)
        projections = {}
        for layers, cpus in plan.projection_groups:
            actor = EngramProjectionActor.options(num_cpus=0, max_concurrency=len(layers) + 2,
                                                  **placement.on_node(plan.engram_node)).remote(
                ckpt, layers, cpus, warmup, projection_delay_ms)
            projections |= {layer: actor for layer in layers}
        stage_actors = [BackboneStageActor.options(**opts).remote(ckpt, (b.start, b.stop), backbone, block_ms)
                        for b, opts in zip(blocks, plan.stage_options)]
        # surface constructor errors now, not at the first step
        ray.get([a.__ray_ready__.remote() for a in [history, *set(projections.values()), *stage_actors]])
        return cls(checkpoint, cfg, history, projections, stage_actors, blocks, prefill_chunk)

    # -- backend hooks -----------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        return ray.get(self.history_actor.encode.remote(text))

    def decode(self, ids: list[int]) -> str:
        return ray.get(self.history_actor.decode.remote(ids))

    def _session_op(self, op: str, *args: str) -> None:
        ray.get([a.session_op.remote(op, *args) for a in [self.history_actor, *self.stage_actors]])

    def _step(self, requests: list[Request]) -> StepResult:
        addr_ref = self.history_actor.append_batch.remote(requests)
        kv_refs = {layer: actor.project.remote(layer, addr_ref) for layer, actor in self.projection_for.items()}
        meta = [StageRequest(r.session, r.start_pos, r.ids.size, r.dead) for r in requests]
        x = [r.ids for r in requests]  # the first stage takes ids; later ones the previous output
        for actor, blocks in zip(self.stage_actors, self.blocks):
            nested = {layer: [kv_refs[layer]] for layer in self.cfg.engram_layer_ids if layer in blocks}
            x = actor.forward_batch.remote(meta, x, nested)
        result = ray.get(x)
        return StepResult(result["logits"], result["waits"])

    # -- inspection --------------------------------------------------------------------------
    def where(self) -> dict:
        return {"projections": ray.get([a.where.remote() for a in set(self.projection_for.values())]),
                "stages": ray.get([a.where.remote() for a in self.stage_actors])}

    def drain_spans(self) -> list[dict]:
        """Every actor's recorded spans since the last drain (wall-clock ns)."""
        return [s for spans in ray.get([a.drain_spans.remote() for a in self.actors()]) for s in spans]

    def stage_stats(self) -> list[dict]:
        return ray.get([a.stats.remote() for a in self.stage_actors])

    def actors(self) -> list:
        return [self.history_actor, *dict.fromkeys(self.projection_for.values()), *self.stage_actors]

    def shutdown(self) -> None:
        for a in self.actors():
            ray.kill(a)
