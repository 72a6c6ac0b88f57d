"""The one scheduler: every step of the engine is made here, whoever asks for tokens (the
server's streams, `generate`, prefill-job rows), in process or through a Ray pipeline.

Requests (request.py) are admitted at step boundaries: a new one gets a session and its
prompt's prefill chunks, and joins the next steps while the others keep decoding. Each step
holds the decodes of the requests that are ready (not in a step in flight), at most a 1/depth
share of them so that `depth` steps (one per pipeline stage) are in flight at once, plus
prefill chunks of the prompts waiting for them, also a 1/depth share, up to a token budget of
one chunk. So a long prompt prefills chunk by chunk between the decodes of the running streams
instead of stopping them for its whole prefill, and prompts that arrive together fill the
pipeline's stages side by side instead of passing through them as one step. A request retires
on EOS, on its sink's word (a stop string, `max_tokens`) or on a cancel (a client gone); its
session is closed at once, or when its step in flight comes back.

Two ways to drive it: the server starts its thread (`start`, requests arrive with `add` from
any thread); `generate` and prefill-job add their requests and `drain` on their own thread
("add requests; step until done"). A session's tokens do not depend on which, nor on the
company it keeps in a step (batched numerics), nor on `depth`: every draw is keyed by (seed,
stream, token index).

Speculative decoding (a runner launched with `speculative`): a decoding request's step is its
verify block, [last token] + the draft layers' tokens (scheduling/speculation.py says which requests
draft); the block's accepted tokens and the next one go to the sink one by one, so a stop
string, `max_tokens` or EOS inside the block ends the request at exactly that token.

Sessions stay the pipeline's unit, so a stage killed mid-stream is recovered by the Pipeline
itself (replay) and the streams go on. When recovery gives up, every open request ends with
the error and the scheduler serves the next ones.
"""
from __future__ import annotations

import collections
import logging
import math
import threading
import time
from collections.abc import Iterator

from engramflow.errors import EngramflowError
from engramflow.model.sampling import Pick, Picked, verifies
from engramflow.scheduling.prefix_reuse import PrefixReuse
from engramflow.scheduling.request import Request, add_waits
from engramflow.scheduling.speculation import SpeculativeStats, decode_writes, picked_rows, speculation_for

log = logging.getLogger("engramflow.scheduler")


class QueueFull(EngramflowError):
    """The waiting queue is full: try again later (HTTP 429)."""


class Scheduler:
    def __init__(self, runner, max_sessions: int = 64, max_queue: int = 256, depth: int | None = None,
                 metrics=None, on_step=None, prefix_cache_bytes: int = 0, tracer=None):
        self.runner = runner
        self.tracer = tracer  # the profiler's StepTracer: a span per step (submitted .. collected) and per draft call
        self.on_step = on_step  # (result, [(request, its write)]) after each collected step
        self.max_sessions, self.max_queue = max_sessions, max_queue
        self.depth = depth or runner.in_flight_default
        self.metrics = metrics
        self._lock = threading.Condition()
        self._waiting: collections.deque[Request] = collections.deque()
        self._active: list[Request] = []  # admitted: prefilling or decoding
        self._in_flight: collections.deque = collections.deque()  # (ticket, [(req, request)])
        self._busy: set[int] = set()  # ids of the reqs in a step in flight
        self._shares = (1, 1)  # decodes and prefill chunks per step, set at each step boundary
        self._stopped = False
        self._thread: threading.Thread | None = None
        self.gave_up: str | None = None  # why the runner's recovery gave up (the runner is spent)
        self.speculative_stats = SpeculativeStats() if runner.speculative is not None else None
        self.prefix = PrefixReuse(runner, prefix_cache_bytes)  # retired sessions kept for their prefix; 0 bytes: off

    # -- from any thread ----------------------------------------------------------------------
    def add(self, req: Request) -> Request:
        with self._lock:
            if self._stopped:
                raise EngramflowError("the server is shutting down")
            if len(self._active) + len(self._waiting) >= self.max_sessions + self.max_queue:
                raise QueueFull(f"the server is full ({self.max_sessions} requests running, "
                                f"{self.max_queue} waiting)")
            self._waiting.append(req)
            self._lock.notify()
        return req

    @property
    def load(self) -> int:
        """Requests admitted or waiting."""
        with self._lock:
            return len(self._active) + len(self._waiting)

    def stats(self) -> dict:
        with self._lock:
            stats = {"waiting": len(self._waiting), "running": len(self._active),
                     "steps_in_flight": len(self._in_flight)}
        if self.speculative_stats is not None:
            stats["speculative"] = self.speculative_stats.as_dict()
        stats |= self.prefix.stats()
        return stats

    def start(self) -> "Scheduler":
        self._thread = threading.Thread(target=self.run, name="engramflow-scheduler", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            self._lock.notify()
        if self._thread is not None:
            self._thread.join()

    # -- the scheduler's thread ---------------------------------------------------------------
    def run(self) -> None:
        while self._wait_for_work():
            with self.runner.deferred_session_ops():  # session ops ride with the steps
                while self._work_left() and not self._stopped:
                    try:
                        self.step()
                    except Exception as e:  # a bug must not leave every client waiting forever
                        log.exception("scheduler step failed")
                        self._fail_all(f"internal error: {type(e).__name__}: {e}")

    # -- or the caller's thread -----------------------------------------------------------------
    def drain(self, feed=None) -> None:
        """Step on the calling thread until every request has retired (see `stepping`)."""
        for _ in self.stepping(feed):
            pass

    def stepping(self, feed=None) -> Iterator[None]:
        """Step on the calling thread, yielding after each step boundary, until every request
        has retired; `feed()`, called before each boundary, may add more (a dataset read as it
        goes). An exception abandons the steps in flight and propagates; the requests' sessions
        stay for the caller to close."""
        with self.runner.deferred_session_ops():  # session ops ride with the steps
            try:
                while True:
                    if feed is not None:
                        feed()
                    if not self._work_left():
                        return
                    self.step()
                    yield
            except BaseException:
                self._in_flight.clear()
                self._busy.clear()
                self.runner.abandon()
                raise

    def _wait_for_work(self) -> bool:
        with self._lock:
            while not self._stopped and not self._waiting and not self._active:
                self._lock.wait()
            return not self._stopped

    def _work_left(self) -> bool:
        with self._lock:
            return bool(self._waiting or self._active or self._in_flight)

    def step(self) -> None:
        """One step boundary: admit, retire the cancelled, fill the pipeline, collect the oldest."""
        self._admit()
        self._retire_cancelled()
        self._shares = self._share(False), self._share(True)  # fixed for this boundary's steps
        while len(self._in_flight) < self.depth and self._submit_next():
            pass
        if self._in_flight:
            self._collect_oldest()
        if self.metrics is not None:
            self.metrics.load(**self.stats())

    def _admit(self) -> None:
        with self._lock:
            room = self.max_sessions - len(self._active)
            new = [self._waiting.popleft() for _ in range(min(room, len(self._waiting)))]
        for req in new:
            self._begin(req, self.runner.open, cached=True)

    def _begin(self, req: Request, new_session, cached: bool = False) -> None:
        """Give a request its session (`new_session()`, or if `cached` a cached prefix's) and its prompt's chunks."""
        if req.cancelled:
            req.sink.on_finish("cancelled")
            return
        try:
            reuse = self.prefix.plan(req) if cached else None  # a cached prefix: fork it, prefill only the rest
            req.session = new_session() if reuse is None else self.prefix.open(reuse)
            first = req.pick_at(0) if req.max_tokens != 0 else Pick()
            req.chunks.extend(self.runner.prefill_requests(req.session, pick=first, image_spans=req.image_spans,
                                                            **self.prefix.rest(req, reuse)))
        except EngramflowError as e:
            self._close(req)
            req.sink.on_error(str(e))
            return
        req.admitted_at = time.perf_counter()
        req.speculation = speculation_for(self.runner, req, self.speculative_stats)
        for chunk in list(req.chunks)[:-1]:  # a middle chunk's logits are not needed: a token is cheaper
            chunk.pick = Pick()
        with self._lock:
            self._active.append(req)

    def _retire_cancelled(self) -> None:
        for req in [j for j in self._active if j.cancelled and id(j) not in self._busy]:
            self._retire(req, "cancelled")

    def _submit_next(self) -> bool:
        """Submit one step of the ready work; False when nothing is ready."""
        ready = [j for j in self._active if id(j) not in self._busy and not j.cancelled]
        work = decode_writes(self.runner, [j for j in ready if not j.chunks][:self._shares[0]], self.speculative_stats,
                             self.tracer and self.tracer.recorder)
        budget = self.runner.prefill_chunk
        for j in [j for j in ready if j.chunks][:self._shares[1]]:
            if work and j.chunks[0].ids.size > budget:
                break
            budget -= j.chunks[0].ids.size
            work.append((j, j.chunks.popleft()))
        if not work:
            return False
        if self.tracer is not None:
            self.tracer.submitted(work)
        ticket = self.runner.submit([r for _, r in work])
        self._in_flight.append((ticket, work))
        self._busy |= {id(j) for j, _ in work}
        return True

    def _share(self, prefilling: bool) -> int:
        """How many of the decoding (or prefilling) requests one step takes: a 1/depth share of
        them, so that the `depth` steps in flight carry equal work and every stage has some.
        Prompts that arrive together are spread the same way: in one step they would pass the
        stages one at a time while the other stages idle, and every stream would wait for all."""
        return math.ceil(sum(1 for j in self._active if bool(j.chunks) == prefilling) / self.depth) or 1

    def _collect_oldest(self) -> None:
        ticket, work = self._in_flight.popleft()
        try:
            result = self.runner.collect(ticket)
        except EngramflowError as e:  # recovery gave up: every open request ends with the error
            self.gave_up = str(e)
            self._fail_all(str(e))
            return
        self._busy -= {id(j) for j, _ in work}
        if self.metrics is not None:
            self.metrics.step(result.exposed_wait_ms)
        if self.tracer is not None:
            self.tracer.collected(result, work)
        if self.on_step is not None:
            self.on_step(result, work)
        for (req, write), out in zip(work, result.logits):
            add_waits(req.waits, result.exposed_wait_ms)
            if req.chunks or req.cancelled:  # a middle prefill chunk, or a client gone
                continue
            if req.max_tokens == 0:  # prefill only: the prompt is written, nothing to pick
                for fork in req.forks:  # n choices: each continues an exact copy of the written prompt
                    self._begin(fork, lambda: self.runner.fork(req.session))
                self._retire(req, "length")
                continue
            if not verifies(write.pick):
                self._token(req, out)
                continue
            tokens = req.speculation.settle(out)  # the verdict; rejected positions rolled back
            if self.metrics is not None:
                self.metrics.speculative(*req.speculation.last_counts)
            for picked in picked_rows(req.speculation.rows, tokens, req.pick(0).logprobs):
                if not self._token(req, picked):  # retired inside the block: the rest is dropped
                    break

    def _token(self, req: Request, picked: Picked) -> bool:
        """Hand one token to the sink; False when that retired the req."""
        req.generated += 1
        req.last_token = picked.token
        if req.constraint is not None:
            req.constraint.advance(picked.token)
        reason = "stop" if picked.token in req.eos_ids else req.sink.on_token(picked)
        if reason is not None:
            self._retire(req, reason)
        return reason is None

    def _retire(self, req: Request, reason: str) -> None:
        with self._lock:
            self._active.remove(req)
        self.prefix.keep(req) or self._close(req)  # kept: the prefix cache owns the session now
        req.sink.on_finish(reason)

    def _close(self, req: Request) -> None:
        if req.keep_session and not req.cancelled:
            return
        if req.session is not None and req.session in self.runner.sessions:
            try:
                self.runner.close(req.session)
            except EngramflowError as e:  # the log drops it anyway; recovery reconciles the actors
                log.warning("closing %s: %s", req.session, e)

    def _fail_all(self, message: str) -> None:
        self._in_flight.clear()
        self._busy.clear()
        self.runner.abandon()
        with self._lock:
            reqs, self._active = self._active, []
        for req in reqs:
            self._close(req)
            req.sink.on_error(message)
