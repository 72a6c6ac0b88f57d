"""The dataflow of one step: history -> projections -> stage chain, all submitted before any wait.

    requests (ids per session)
        |
        v
    history actor .append_batch ---------> addr_ref  (hashed Engram addresses, an ObjectRef)
        |                                    |
        |            +-----------------------+----------------------+
        |            v                       v                      v
        |   projection actor .project   (one call per Engram layer, on addr_ref:
        |   (or .rows: the stage          K/V, or the raw rows when the stage projects)
        |    projects)                        |
        |            +-------- kv_refs[layer] +----------------------+
        v            v (only the layers inside each stage's blocks, nested)
    stage 0 .forward_batch(meta, ids, {layer: [kv_ref]}) --> x0_ref
    stage 1 .forward_batch(meta, x0_ref, {layer: [kv_ref]}) --> x1_ref
    ...
    stage K-1 ----------------------------------------------> logits or Picks (the ticket's ref)

The driver never waits here: each call takes the previous call's ObjectRef, so a stage
starts its early blocks at once and blocks only when it reaches an Engram layer whose K/V
are not there yet. Every actor runs its calls in the order the driver made them, so several
steps can be in flight (stage g on one step, stage g+1 on the one before). What crosses each
hop is in docs/architecture.md.
"""
from __future__ import annotations

import dataclasses
import time

from engramflow.model.sampling import verifies
from engramflow.model.speculative import Verify
from engramflow.model.stage_batch import StageRequest
from engramflow.pipeline.image_inputs import history_writes, reencoded, wire_slots
from engramflow.pipeline.step import Request


class Dataflow:
    def __init__(self, slots: dict, layer_slot: dict[int, str], blocks: list[range], placement):
        self.slots = slots  # name -> Slot; a restarted actor is swapped in its slot
        self.layer_slot = layer_slot  # Engram layer -> the projection slot that owns it
        self.blocks = blocks  # stage g's blocks
        self.placement = placement  # where each layer is projected this step: "host" or "stage"
        # a profiler's SpanRecorder, or None: then each step marks the instants its history and
        # first-stage calls leave the driver, so its hop report starts those hops there and not
        # at the driver's bookkeeping before them
        self.marks = None

    def encode_image(self, image) -> object:
        """The first stage runs the vision tower (next to the embedding it overwrites, on its
        device); the rows come back as an object ref that the step's forward resolves."""
        return self.stage_actors[0].encode.remote(image)

    def submit(self, requests: list[Request], ops: list = (), fresh_images: bool = False):
        """Submit one step through every actor without waiting; the last stage's output ref.
        `ops`: held-back session ops, run first by the history and every stage actor.
        `fresh_images`: encode the requests' images again (after a fault the old rows'
        references may hold the error)."""
        if fresh_images:
            requests = reencoded(requests, self.encode_image)
        self.mark("send history")
        addr_ref = self.slots["history"].actor.append_batch.remote(history_writes(requests), ops)  # no image data
        tokens = sum(r.ids.size for r in requests)
        meta = [StageRequest(r.session, r.start_pos, r.ids.size, r.dead, r.pick, wire_slots(r.images))
                for r in requests]
        # a pick (a grammar's 16 KB mask with it) is the last stage's: the others need only
        # whether the rows verify a drafted block
        upstream = [dataclasses.replace(m, pick=Verify() if verifies(m.pick) else None) for m in meta]
        x = [r.ids for r in requests]  # the first stage takes ids; later ones the previous output
        last = len(self.blocks) - 1
        for g, (actor, blocks) in enumerate(zip(self.stage_actors, self.blocks)):
            # each layer's projection is submitted right before the first stage that takes it: the
            # first stage's call leaves the driver sooner, and the projection still starts as soon
            # as the history's addresses exist (a call waits for its arguments, not its turn)
            nested = {layer: [self._project(layer, tokens, addr_ref)] for layer in sorted(self.layer_slot)
                      if layer in blocks}
            if g == 0:
                self.mark("send stage")
            x = actor.forward_batch.remote(meta if g == last else upstream, x, nested, ops)
        return x

    def mark(self, name: str) -> None:
        if self.marks is not None:
            now = time.time_ns()
            self.marks.add(name, now, now)

    def _project(self, layer: int, tokens: int, addr_ref):
        method = "project" if self.placement.choose(layer, tokens) == "host" else "rows"
        return getattr(self.slots[self.layer_slot[layer]].actor, method).remote(layer, addr_ref)

    @property
    def stage_actors(self) -> list:
        return [s.actor for s in self.slots.values() if s.role == "stage"]
