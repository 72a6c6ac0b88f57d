"""A Pipeline's actors taken over by a new driver, in a known state.

When a pipeline's actors are owned by another process than its driver (a Serve replica whose
keeper made them: serve/keeper.py), they outlive a driver that dies. A new driver rebuilds the
Pipeline object around them from its `recipe` instead of starting every actor again (worker
processes, torch imports, checkpoint loads: the bulk of a replica's start). What the old driver
knew is gone with it, so the adopted pipeline starts from nothing: an actor that does not
answer is made again, and every stateful actor drops every session (the dead driver's
sessions are over; their requests already got an error from the proxy).
"""
from __future__ import annotations

import ray

from engramflow.errors import EngramflowError
from engramflow.pipeline.faults import alive
from engramflow.pipeline.launch import START_TIMEOUT_S

PING_S = 5.0  # an actor that does not answer its ping within this is made again


def recipe(pipe) -> dict:
    """What `adopt` needs to rebuild `pipe` around its actors (picklable by Ray)."""
    return {"checkpoint": pipe.checkpoint, "cfg": pipe.cfg, "slots": pipe.slots,
            "layer_slot": pipe.dataflow.layer_slot, "blocks": pipe.blocks, "prefill_chunk": pipe.prefill_chunk,
            "policy": pipe.policy, "placement": pipe.placement, "backbone": pipe.backbone,
            "in_flight": pipe.in_flight_default, "placement_groups": pipe.placement_groups,
            "vision_cfg": pipe.vision_cfg, "numerics": pipe.numerics, "speculative": pipe.speculative,
            "speculative_gate": pipe.speculative_gate, "config": pipe.config}


def adopt(cls, r: dict, actors: dict | None = None):
    """A Pipeline (class `cls`) over the actors of recipe `r`; `actors` (slot name -> handle)
    overrides the recipe's where a recovery replaced one after the recipe was taken. Returns
    a pipeline holding no session, every actor answering."""
    slots = r["slots"]
    for name, handle in (actors or {}).items():
        if name in slots:
            slots[name].actor = handle
    dead = [name for name, slot in slots.items() if not alive(slot.actor, PING_S)]
    for name in dead:  # a fresh one, as recovery would make it
        ray.kill(slots[name].actor, no_restart=True)
        slots[name].actor = slots[name].make()
    errors = ray.get([slots[name].actor.init_error.remote() for name in dead], timeout=START_TIMEOUT_S)
    if any(errors):
        raise EngramflowError(next(e for e in errors if e))
    pipe = cls(r["checkpoint"], r["cfg"], slots, r["layer_slot"], r["blocks"], r["prefill_chunk"], r["policy"],
               placement=r["placement"], backbone=r["backbone"], in_flight=r["in_flight"],
               placement_groups=r["placement_groups"], vision_cfg=r["vision_cfg"], numerics=r["numerics"],
               speculative=r["speculative"], speculative_gate=r["speculative_gate"])
    pipe.config = r["config"]
    pipe.recovery.sync()  # the log is empty: every stateful actor closes what the dead driver left open
    pipe.adopted = dead  # for the caller's log: which actors had to be made again
    return pipe
