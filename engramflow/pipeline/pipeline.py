"""The Ray pipeline: a Runner whose step runs on actors (history -> projections -> stages).

How a step travels, file by file:

    Runner.generate (runner.py ->          checks the prompts, makes one scheduler Request per prompt
      generate in generation.py)
      Scheduler.step (scheduling/)         admits, packs prefill chunks and decodes into steps,
                                           keeps `depth` in flight, collects oldest first
          Runner.submit (runner.py)        checks the step, records it as in flight
            Pipeline._submit (here)        guarded by Recovery, carries the held-back session ops
              Dataflow.submit (dataflow.py)  history -> projections -> stage chain, no waits
          Runner.collect -> Pipeline._collect  waits for the last stage's ref; writes enter the log

Recovery (recovery.py) wraps every actor call; the held-back session ops live in held_ops.py;
launch.py starts the actors.
"""
from __future__ import annotations

import time
from pathlib import Path

import ray

from engramflow.errors import EngramflowError
from engramflow.pipeline.dataflow import Dataflow
from engramflow.pipeline.held_ops import HeldOps
from engramflow.pipeline.launch import Slot, launch, release
from engramflow.pipeline.metrics import PipelineMetrics
from engramflow.pipeline.projection_placement import ProjectionPlacement
from engramflow.pipeline.recovery import Recovery, RecoveryPolicy
from engramflow.pipeline.runner import Runner
from engramflow.pipeline.step import StepResult, Ticket


class Pipeline(Runner):
    def __init__(self, checkpoint: Path, cfg, slots: dict[str, Slot], layer_slot: dict[int, str],
                 blocks: list[range], prefill_chunk: int, policy: RecoveryPolicy, *,
                 placement: ProjectionPlacement | None = None, backbone: str | None = None,
                 in_flight: int = 1, placement_groups=(), vision_cfg=None, numerics: str | None = None,
                 speculative: int | None = None, speculative_gate: float | None = None):
        super().__init__()
        self.numerics = numerics  # the stages' summation orders (kernels/sum_order.py)
        self.speculative, self.speculative_gate = speculative, speculative_gate  # DSpark drafts per step, the gate
        self.checkpoint, self.cfg, self.backbone = checkpoint, cfg, backbone
        self.slots = slots
        self.blocks = blocks
        self.prefill_chunk = prefill_chunk
        self.in_flight_default = in_flight
        self.placement = placement or ProjectionPlacement("host")
        self.placement_groups = placement_groups  # the stages' GPUs, the projection actors' CPUs: removed at shutdown
        self.vision_cfg = vision_cfg  # a VisionConfig when the checkpoint has a vision tower
        self.policy = policy
        self.dataflow = Dataflow(slots, layer_slot, blocks, self.placement)
        self.recovery = Recovery(self, policy)
        self.ops = HeldOps(self.fetch)
        self.metrics = PipelineMetrics()
        self._closed = False

    launch = classmethod(launch)  # launch.py

    def cached_token_bytes(self) -> list[int]:
        """Bytes one cached position costs on each stage (token_cost.py: the prefix cache's unit)."""
        from engramflow.io.checkpoint import Checkpoint
        from engramflow.model.token_cost import stage_token_bytes

        ckpt = Checkpoint(self.checkpoint)  # the config and headers only: no tensor is read
        try:
            return stage_token_bytes(ckpt, self.backbone, self.blocks, self.speculative is not None)
        finally:
            ckpt.close()

    @property
    def history_actor(self):
        return self.slots["history"].actor

    @property
    def stage_actors(self) -> list:
        return self.dataflow.stage_actors

    @property
    def stateful_actors(self) -> list:
        return [s.actor for s in self.slots.values() if s.stateful]

    # -- backend hooks -----------------------------------------------------------------------
    def _guarded(self, call):
        if self._closed:
            raise EngramflowError("this pipeline is shut down")
        return self.recovery.guarded(call)

    def _encode_image(self, image) -> object:
        return self.dataflow.encode_image(image)

    def encode(self, text: str) -> list[int]:
        return self._guarded(lambda: self.fetch(self.history_actor.encode.remote(text)))

    def decode(self, ids: list[int]) -> str:
        return self._guarded(lambda: self.fetch(self.history_actor.decode.remote(ids)))

    def _draft(self, session: str, token: int, start: int, n: int, sampling, stream: int, step: int):
        return self.drafts([(session, token, start, n, sampling, stream, step)])[0]

    def drafts(self, asks: list[tuple]) -> list:
        """DSpark drafts of several sessions from the last stage, in one forward of its draft
        layers (the call queues behind the stage's calls, so it sees every write)."""
        return self._guarded(lambda: self.fetch(self.stage_actors[-1].drafts.remote(asks)))

    def _session_op(self, op: str, *args: str) -> None:
        """The driver's log already holds the op (Runner): send it to every stateful actor;
        the send is idempotent, so a retry after a fault (or a sync) cannot trip over it.
        While steps are in flight (or ops are deferred) it is held back instead: it goes with
        the next step's calls, which run it first, so it costs no call of its own."""
        self._guarded(lambda: self._send_op(op, *args))

    def _send_op(self, op: str, *args: str) -> None:
        if self.outstanding or self._defer_ops:  # a fault shows when a later step is collected
            return self.ops.hold(op, args)
        self.ops.flush(self.stateful_actors)
        self.fetch([a.session_op.remote(op, *args) for a in self.stateful_actors])

    def _deferral_ended(self) -> None:
        if not self._closed:
            self.ops.flush(self.stateful_actors)

    def _out_of_sync(self) -> None:
        self.recovery.needs_sync = True  # reconcile every stateful actor to the log before the next call

    def _abandoned(self) -> None:
        self.recovery.needs_sync = True  # actors may hold writes of abandoned steps

    def _submit(self, ticket: Ticket) -> None:
        attempts = 0

        def once():
            nonlocal attempts
            ticket.ops = self.ops.take()  # (a sync before this emptied them: they are in the log)
            # a retry follows a fault: the first try's image rows may hold it
            ticket.ref = self.dataflow.submit(ticket.requests, ticket.ops, fresh_images=attempts > 0)
            ticket.submitted_at = time.perf_counter()
            attempts += 1
        self._guarded(once)

    def _collect(self, ticket: Ticket) -> StepResult:
        alone = len(self.tickets()) == 1  # its wall time is its own: auto learns the backbone's time from it

        def wait():
            out = self.fetch(ticket.ref)
            self.dataflow.mark("result")
            self.ops.settle(block=alone)  # the last step in flight: wait for every flushed op
            return StepResult(out["logits"], out["waits"], bytes_moved=out["bytes"])
        result = self._guarded(wait)
        step_s = time.perf_counter() - ticket.submitted_at
        self.metrics.step(step_s * 1e3, result.exposed_wait_ms)
        if alone:
            self.placement.observe(ticket.tokens, step_s - sum(result.exposed_wait_ms.values()) / 1e3)
        return result

    def tickets(self) -> list[Ticket]:
        """The steps in flight, oldest first."""
        return list({id(t): t for t in self.outstanding.values()}.values())

    def fetch(self, refs):
        return ray.get(refs, timeout=self.policy.step_timeout_s)

    # -- inspection --------------------------------------------------------------------------
    def where(self) -> dict:
        return {"projections": ray.get([s.actor.where.remote() for s in self.slots.values() if s.role == "projection"]),
                "stages": ray.get([a.where.remote() for a in self.stage_actors])}

    def drain_spans(self) -> list[dict]:
        """Every actor's recorded spans since the last drain (wall-clock ns)."""
        return [s for spans in ray.get([a.drain_spans.remote() for a in self.actors()]) for s in spans]

    def stage_stats(self) -> list[dict]:
        return ray.get([a.stats.remote() for a in self.stage_actors])

    def history_sessions(self) -> int:
        return ray.get(self.history_actor.live_sessions.remote())

    def actor_sessions(self) -> dict[str, list[str]]:
        """Each stateful actor's session names (they equal the driver's `sessions` when in sync)."""
        return self._ask_stateful("sessions")

    def memory(self) -> dict[str, dict]:
        """Each stateful actor's resident memory (`rss()`: pid, rss_bytes, live_sessions, ...)."""
        return self._ask_stateful("rss")

    def _ask_stateful(self, method: str) -> dict:
        names = [n for n, s in self.slots.items() if s.stateful]
        return dict(zip(names, ray.get([getattr(self.slots[n].actor, method).remote() for n in names])))

    def actors(self) -> list:
        return [s.actor for s in self.slots.values()]

    def actor(self, name: str):
        """The live handle of a slot: "history", "projection0", "stage0", ..."""
        return self.slots[name].actor

    def shutdown(self) -> None:
        if not self._closed:
            self._closed = True
            release(self.actors(), self.placement_groups)
