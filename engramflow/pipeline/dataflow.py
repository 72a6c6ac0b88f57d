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

from engramflow.model.stage_batch import StageRequest
from engramflow.pipeline.image_inputs import reencoded, wire_slots, without_images
from engramflow.pipeline.step import Request


class Dataflow:
    def __init__(self, slots: dict, layer_slot: dict[int, str], blocks: list[range], placement):
        self.slots = slots  # name -> Slot; a restarted actor is swapped in its slot
        self.layer_slot = layer_slot  # Engram layer -> the projection slot that owns it
        self.blocks = blocks  # stage g's blocks
        self.placement = placement  # where each layer is projected this step: "host" or "stage"

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
        addr_ref = self.slots["history"].actor.append_batch.remote(without_images(requests), ops)  # no image data
        tokens = sum(r.ids.size for r in requests)
        kv_refs = {}
        for layer, name in self.layer_slot.items():
            method = "project" if self.placement.choose(layer, tokens) == "host" else "rows"
            kv_refs[layer] = getattr(self.slots[name].actor, method).remote(layer, addr_ref)
        meta = [StageRequest(r.session, r.start_pos, r.ids.size, r.dead, r.pick, wire_slots(r.images))
                for r in requests]
        x = [r.ids for r in requests]  # the first stage takes ids; later ones the previous output
        for actor, blocks in zip(self.stage_actors, self.blocks):
            nested = {layer: [kv_refs[layer]] for layer in sorted(kv_refs) if layer in blocks}
            x = actor.forward_batch.remote(meta, x, nested, ops)
        return x

    @property
    def stage_actors(self) -> list:
        return [s.actor for s in self.slots.values() if s.role == "stage"]
