"""The Ray pipeline (DESIGN §3): history actor -> projection actors -> stage actor chain.

Each step the driver submits everything before it waits: the history append (addresses as
an ObjectRef), one projection per Engram layer on that ref, and the whole stage chain, each
stage taking the previous one's output ref and the K/V refs of its Engram layers nested, so a
stage starts its early blocks at once and blocks only on reaching an Engram layer.

Several steps can be in flight (Runner.submit / collect): every actor runs its calls in the
order the driver made them, so stage g works on one step while stage g+1 works on the one
before. Session operations made while steps are in flight are not waited for (they queue
behind those steps on each actor); their results are checked as steps are collected.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import ray
from ray.exceptions import GetTimeoutError, RayError

from engramflow.actors.history_actor import TokenizerHistoryActor
from engramflow.actors.projection_actor import EngramProjectionActor
from engramflow.actors.stage_actor import BackboneStageActor
from engramflow.errors import EngramflowError
from engramflow.model.backbones import KINDS, default_backbone, projection_numerics, stage_blocks
from engramflow.io.checkpoint import Checkpoint
from engramflow.pipeline import placement
from engramflow.pipeline.metrics import PipelineMetrics
from engramflow.pipeline.placement_calibration import check_rates, make_placement
from engramflow.pipeline.projection_placement import ProjectionPlacement, check_projection_mode
from engramflow.pipeline.ray_address import check_ray_address
from engramflow.tiers.config import TiersConfig, parse_tiers
from engramflow.memory.history import SessionHistory
from engramflow.pipeline.recovery import RecoveryPolicy, RecoveryStats, alive, is_fault, one_line, user_error
from engramflow.pipeline.in_flight import check_in_flight
from engramflow.pipeline.runner import Runner, check_run_options
from engramflow.pipeline.step import Request, StepResult, Ticket
from engramflow.model.stage_batch import StageRequest
from engramflow.model.v41.vision.encoder import vision_config
from engramflow.pipeline.image_inputs import reencoded, wire_slots, without_images

log = logging.getLogger("engramflow.pipeline")
T = TypeVar("T")
START_TIMEOUT_S = 300.0  # actors that cannot be placed in this time: the cluster lacks what they request
REPLAY_STEP_CHUNKS = 4  # a replay step holds one segment of many sessions, up to this many prefill chunks


def ensure_ray(address: str | None) -> None:
    if ray.is_initialized():
        return
    try:
        if address is None:
            ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False,
                     configure_logging=False)
        else:
            check_ray_address(address)  # fail in seconds, not after ray.init's retries
            ray.init(address=address, log_to_driver=False)
    except EngramflowError:
        raise
    except Exception as e:  # ConnectionError, RuntimeError, ValueError, Ray's own (e.g. authentication)
        raise EngramflowError(f"cannot start or reach Ray at {address or 'a new local instance'!r}: {e}") from None


@dataclasses.dataclass
class Slot:
    """One actor of the pipeline and how to make it again."""
    role: str  # "history", "projection" or "stage"
    make: Callable[[], object]
    actor: object = None
    stateful: bool = True  # holds per-session state that replay must rebuild


def _release(actors: list, pg) -> None:
    for a in actors:
        try:
            ray.kill(a, no_restart=True)
        except Exception:  # already gone
            pass
    if pg is not None:
        ray.util.remove_placement_group(pg)


class Pipeline(Runner):
    def __init__(self, checkpoint: Path, cfg, slots: dict[str, Slot], layer_slot: dict[int, str],
                 blocks: list[range], prefill_chunk: int, policy: RecoveryPolicy):
        super().__init__()
        self.checkpoint, self.cfg = checkpoint, cfg
        self.slots = slots
        self.layer_slot = layer_slot  # Engram layer id -> projection slot name
        self.blocks = blocks
        self.prefill_chunk = prefill_chunk
        self.policy = policy
        self.recovery = RecoveryStats()
        self.metrics = PipelineMetrics()
        self.placement_group = None
        self.placement = ProjectionPlacement("host")  # launch() sets the chosen one
        self._needs_sync = False  # stateful actors may disagree with the log: reconcile and replay
        self._closed = False
        self._pending_ops: list = []  # refs of session ops sent without waiting: checked later
        self._queued_ops: list = []  # (op, args) held back: they ride with the next step

    @classmethod
    def launch(cls, checkpoint: str | Path, stages: int = 1, address: str | None = None,
               backbone: str | None = None, block_ms: float = 1.0, prefill_chunk: int = 512,
               warmup: bool = False, projection_delay_ms: dict[int, float] | None = None,
               policy: RecoveryPolicy | None = None, tiers: dict | TiersConfig | None = None,
               in_flight: int | None = None, projection: str = "host",
               placement_rates: dict | None = None) -> "Pipeline":
        """`in_flight`: the steps generate() keeps in flight (default: one per stage). `projection`:
        where Engram layers are projected, "host" | "stage" | "auto" (per step and layer, from rates
        measured at launch: pipeline/projection_placement.py); `placement_rates` overrides them."""
        check_projection_mode(projection)
        check_rates(placement_rates)
        checkpoint = Path(checkpoint).resolve()
        # validate on the driver first (checkpoint and token map): clear errors, no actors
        ckpt_obj = Checkpoint(checkpoint)
        SessionHistory.from_checkpoint(ckpt_obj)
        backbone = backbone or default_backbone(checkpoint)  # v41 for a V4.1 checkpoint
        # tiers checked here, before any actor: files only when they are local to the driver
        cfg = ckpt_obj.config
        vision = vision_config(ckpt_obj)
        tiers = parse_tiers(tiers, cfg.engram_layer_ids, check_files=address is None) if tiers else None
        ckpt_obj.close()
        if backbone not in KINDS:
            raise EngramflowError(f"unknown backbone {backbone!r}; choose one of {', '.join(KINDS)}")
        blocks = stage_blocks(backbone, ckpt_obj, stages)
        in_flight = check_in_flight(stages if in_flight is None else in_flight)
        check_run_options(block_ms, prefill_chunk)
        ensure_ray(address)
        plan = placement.plan(list(cfg.engram_layer_ids), stages)
        ckpt = str(checkpoint)
        driver = ray.get_runtime_context().get_node_id()
        slots = {"history": Slot("history", lambda: TokenizerHistoryActor.options(
            num_cpus=0, **placement.on_node(driver)).remote(ckpt))}
        layer_slot = {}
        for k, (layers, cpus) in enumerate(plan.projection_groups):
            opts = {"max_concurrency": len(layers) + 2} | plan.projection_options(k)
            slots[f"projection{k}"] = Slot("projection", lambda o=opts, l=layers, c=cpus: EngramProjectionActor.options(
                **o).remote(ckpt, l, c, warmup, projection_delay_ms, tiers, projection_numerics(backbone)),
                stateful=False)
            layer_slot |= {layer: f"projection{k}" for layer in layers}
        for g, (b, opts) in enumerate(zip(blocks, plan.stage_options)):
            slots[f"stage{g}"] = Slot("stage", lambda o=opts, b=b: BackboneStageActor.options(**o).remote(
                ckpt, (b.start, b.stop), backbone, block_ms, projection != "host"))
        try:  # make every actor and surface constructor errors now, not at the first step
            for slot in slots.values():
                slot.actor = slot.make()
            errors = ray.get([slot.actor.init_error.remote() for slot in slots.values()], timeout=START_TIMEOUT_S)
        except (RayError, GetTimeoutError) as e:
            _release([s.actor for s in slots.values() if s.actor is not None], plan.placement_group)
            if isinstance(e, GetTimeoutError):
                raise EngramflowError(f"the pipeline's actors did not start within {START_TIMEOUT_S:.0f} s: the "
                                      f"cluster lacks the resources they request ({plan.describe()})") from None
            raise user_error(e) or EngramflowError(f"the pipeline's actors failed to start: {one_line(e)}") from None
        if any(errors):
            _release([s.actor for s in slots.values()], plan.placement_group)
            raise EngramflowError(next(err for err in errors if err))
        pipe = cls(checkpoint, cfg, slots, layer_slot, blocks, prefill_chunk, policy or RecoveryPolicy())
        pipe.placement_group = plan.placement_group
        pipe.backbone = backbone
        pipe.in_flight_default = in_flight
        pipe.vision_cfg = vision if vision.enabled else None
        try:
            pipe.placement = make_placement(projection, cfg, [s.actor for s in slots.values() if s.role == "projection"],
                                            pipe.stage_actors, placement_rates)
        except BaseException:
            pipe.shutdown()
            raise
        return pipe

    @property
    def history_actor(self):
        return self.slots["history"].actor

    @property
    def stage_actors(self) -> list:
        return [s.actor for s in self.slots.values() if s.role == "stage"]

    # -- backend hooks -----------------------------------------------------------------------
    def _encode_image(self, image) -> object:
        """The first stage runs the vision tower (next to the embedding it overwrites, on its
        device); the rows come back as an object ref that the step's forward resolves."""
        return self.stage_actors[0].encode.remote(image)

    def encode(self, text: str) -> list[int]:
        return self._guarded(lambda retry: self._get(self.history_actor.encode.remote(text)))

    def decode(self, ids: list[int]) -> str:
        return self._guarded(lambda retry: self._get(self.history_actor.decode.remote(ids)))

    def _session_op(self, op: str, *args: str) -> None:
        """The driver's log already holds the op (Runner): send it to every stateful actor;
        the send is idempotent, so a retry after a fault (or a sync) cannot trip over it."""
        self._guarded(lambda retry: self._session_op_once(op, *args))

    def _session_op_once(self, op: str, *args: str) -> None:
        if self.outstanding or self._defer_ops:
            # held back: it goes with the next step's calls (to the history and every stage),
            # which run it first, so it costs no call of its own; a fault shows at a collect
            self._queued_ops.append((op, args))
            return
        self._flush_ops()
        self._get([a.session_op.remote(op, *args) for a in self._stateful()])

    def _stateful(self) -> list:
        return [s.actor for s in self.slots.values() if s.stateful]

    def _flush_ops(self) -> None:
        """Send the held-back ops in one call per actor, without waiting (checked later)."""
        if self._queued_ops:
            ops, self._queued_ops = self._queued_ops, []
            self._pending_ops += [a.session_ops.remote(ops) for a in self._stateful()]

    def _deferral_ended(self) -> None:
        if not self._closed:
            self._flush_ops()

    def _settle_ops(self, block: bool) -> None:
        """Raise the fault of any deferred session op that has finished (all of them: `block`)."""
        if not self._pending_ops:
            return
        if block:
            done, self._pending_ops = self._pending_ops, []
        else:
            done, self._pending_ops = ray.wait(self._pending_ops, num_returns=len(self._pending_ops), timeout=0)
        self._get(done)

    def _out_of_sync(self) -> None:
        self._needs_sync = True  # reconcile every stateful actor to the log before the next call

    def _abandoned(self) -> None:
        self._needs_sync = True  # actors may hold writes of abandoned steps

    def _submit(self, requests: list[Request]) -> tuple:
        def once(retry: bool) -> tuple:
            ops, self._queued_ops = self._queued_ops, []  # (a sync before this emptied them: in the log)
            reqs = reencoded(requests, self._encode_image) if retry else requests  # old image refs may hold the fault
            return self._submit_once(reqs, ops), time.perf_counter(), ops
        return self._guarded(once)

    def _collect(self, ticket: Ticket) -> StepResult:
        alone = len(self._tickets()) == 1  # its wall time is its own: auto learns the backbone's time from it
        result = self._guarded(lambda retry: self._collect_once(ticket))
        step_s = time.perf_counter() - ticket.handle[1]
        self.metrics.step(step_s * 1e3, result.exposed_wait_ms)
        if alone:
            self.placement.observe(sum(r.ids.size for r in ticket.requests),
                                   step_s - sum(result.exposed_wait_ms.values()) / 1e3)
        return result

    def _collect_once(self, ticket: Ticket) -> StepResult:
        out = self._get(ticket.handle[0])
        self._settle_ops(block=len(self._tickets()) == 1)  # the last step in flight: wait for all
        return StepResult(out["logits"], out["waits"], bytes_moved=out["bytes"])

    def _tickets(self) -> list[Ticket]:
        """The steps in flight, oldest first."""
        return list({id(t): t for t in self.outstanding.values()}.values())

    def _get(self, refs):
        return ray.get(refs, timeout=self.policy.step_timeout_s)

    def _submit_once(self, requests: list[Request], ops: list = ()):
        """Submit one step through every actor without waiting; the last stage's output ref.
        `ops`: held-back session ops, run first by the history and every stage actor."""
        addr_ref = self.history_actor.append_batch.remote(without_images(requests), ops)  # ids and DEAD masks only
        tokens = sum(r.ids.size for r in requests)  # K/V (host projects) or rows (the stage projects)
        kv_refs = {layer: getattr(self.slots[name].actor, "project" if self.placement.choose(layer, tokens) == "host"
                                  else "rows").remote(layer, addr_ref)
                   for layer, name in self.layer_slot.items()}
        meta = [StageRequest(r.session, r.start_pos, r.ids.size, r.dead, r.pick, wire_slots(r.images)) for r in requests]
        x = [r.ids for r in requests]  # the first stage takes ids; later ones the previous output
        for actor, blocks in zip(self.stage_actors, self.blocks):
            nested = {layer: [kv_refs[layer]] for layer in self.cfg.engram_layer_ids if layer in blocks}
            x = actor.forward_batch.remote(meta, x, nested, ops)
        return x

    # -- recovery ----------------------------------------------------------------------------
    def _guarded(self, call: Callable[[bool], T]) -> T:
        """Run `call(retry)`; on an actor fault, rebuild what died, reconcile the stateful actors
        to the driver's log and try again (bounded). A fault during recovery counts as one more
        attempt. User errors and bugs are not retried: they surface at once as one-line
        EngramflowErrors."""
        if self._closed:
            raise EngramflowError("this pipeline is shut down")
        fault: BaseException | None = None
        for attempt in range(self.policy.max_retries + 1):
            try:
                if fault is not None:
                    self._recover(fault)
                if self._needs_sync:
                    self._sync()
                return call(attempt > 0)
            except RayError as e:
                user = user_error(e)
                if user is not None:
                    raise user from None
                if not is_fault(e):
                    raise EngramflowError(f"pipeline actor failed: {one_line(e)}") from e
                if attempt == self.policy.max_retries:
                    raise EngramflowError(f"giving up after {attempt} retries: {one_line(e)}") from e
                fault = e
        raise AssertionError("unreachable")

    def _recover(self, error: BaseException) -> None:
        t0 = time.perf_counter()
        self.recovery.faults += 1
        self.metrics.recovered("faults")
        dead = [name for name, slot in self.slots.items() if not alive(slot.actor, self.policy.ping_timeout_s)]
        log.warning("actor fault (%s); dead: %s", type(error).__name__, dead or "none")
        for name in dead:
            if self.recovery.restarts >= self.policy.max_restarts:
                raise EngramflowError(f"actor {name} died and the restart budget ({self.policy.max_restarts}) is spent")
            self.recovery.restarts += 1
            self.metrics.recovered("restarts")
            ray.kill(self.slots[name].actor, no_restart=True)  # a hung one must let go of its GPU
            self.slots[name].actor = self.slots[name].make()
            if self.slots[name].stateful:
                self._needs_sync = True
        if self._needs_sync:
            self._sync()
        else:
            self._resubmit()
        seconds = time.perf_counter() - t0
        self.recovery.max_recovery_s = max(self.recovery.max_recovery_s, seconds)
        self.recovery.events.append({"dead": dead, "seconds": seconds, "error": type(error).__name__})
        log.warning("recovered in %.2f s (restarted %s)", seconds, dead)

    def _sync(self) -> None:
        """Make every stateful actor hold exactly the log's sessions, then replay their writes.

        The log is the truth: an actor closes the sessions the log no longer has (a close that
        reached it before a fault), opens the ones it lacks (a new actor, an open or fork that
        did not reach it) and empties the rest; then every session's segments are written
        again through the whole pipeline, in their original chunks, the k-th segment of many
        sessions in one step (up to REPLAY_STEP_CHUNKS prefill chunks of tokens). Until this
        completes the flag stays set, so a fault during it syncs again."""
        self._needs_sync = True
        self._pending_ops = []  # the reconcile below supersedes them (the log holds every op)
        self._queued_ops = []
        names = list(self._log)
        stateful = [s.actor for s in self.slots.values() if s.stateful]
        self._get([a.sync_sessions.remote(names) for a in stateful])
        logs = [(session, session_log.segments) for session, session_log in self._log.items()]
        budget = REPLAY_STEP_CHUNKS * self.prefill_chunk  # tokens per replay step, at most
        for k in range(max((len(segs) for _, segs in logs), default=0)):
            batch, tokens = [], 0
            for session, segs in logs:
                if k >= len(segs):
                    continue
                if batch and tokens + segs[k].ids.size > budget:
                    self._replay(batch)
                    batch, tokens = [], 0
                batch.append(Request(session, segs[k].ids, segs[k].start_pos, segs[k].dead, images=segs[k].images))
                tokens += segs[k].ids.size
            self._replay(batch)
        self._needs_sync = False
        self._resubmit()  # the steps in flight were made before the replay

    def _resubmit(self) -> None:
        """Submit every step in flight again, oldest first (after a fault: their refs may hold
        its error; each write names its start_pos, so a step already done is done again)."""
        for ticket in self._tickets():  # with their ops again: an actor whose call never ran lacks them
            _, t0, ops = ticket.handle
            ticket.handle = (self._submit_once(reencoded(ticket.requests, self._encode_image), ops), t0, ops)

    def _replay(self, batch: list[Request]) -> None:
        if batch:
            self._get(self._submit_once(reencoded(batch, self._encode_image)))
            self.recovery.replayed_segments += len(batch)
            self.metrics.recovered("replayed_segments", len(batch))

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
        names = [n for n, s in self.slots.items() if s.stateful]
        return dict(zip(names, ray.get([self.slots[n].actor.sessions.remote() for n in names])))

    def memory(self) -> dict[str, dict]:
        """Each stateful actor's resident memory (`rss()`: pid, rss_bytes, live_sessions, ...)."""
        names = [n for n, s in self.slots.items() if s.stateful]
        return dict(zip(names, ray.get([self.slots[n].actor.rss.remote() for n in names])))

    def actors(self) -> list:
        return [s.actor for s in self.slots.values()]

    def actor(self, name: str):
        """The live handle of a slot: "history", "projection0", "stage0", ..."""
        return self.slots[name].actor

    def shutdown(self) -> None:
        if not self._closed:
            self._closed = True
            _release(self.actors(), self.placement_group)
