"""The serving scheduler (continuous batching) on the in-process Engine: tokens equal
`generate` whatever arrives when, retirement closes sessions, long prompts prefill in chunks
between decodes, overload is refused, a failing runner ends every open request."""
import threading

import pytest

from engramflow.model.sampling import Sampling
from engramflow.pipeline.engine import Engine
from engramflow.serve.picking import pick_factory
from engramflow.scheduling import QueueFull, Request, Scheduler


class Collect:
    """A sink that keeps what it is given (stops after `limit` tokens)."""

    def __init__(self, limit: int):
        self.limit, self.tokens, self.reason, self.error = limit, [], None, None
        self.done = threading.Event()

    def on_token(self, picked):
        self.tokens.append(picked.token)
        return "length" if len(self.tokens) >= self.limit else None

    def on_finish(self, reason):
        self.reason = reason
        self.done.set()

    def on_error(self, message):
        self.error = message
        self.done.set()


@pytest.fixture(scope="module")
def engine(tiny_ckpt):
    e = Engine(tiny_ckpt, backbone="reference", prefill_chunk=16)
    yield e
    e.shutdown()


def _job(prompt, n, sampling=Sampling(), eos=frozenset()):
    return Request(list(prompt), pick_factory(sampling), Collect(n), eos)


def _drain(sched: Scheduler, jobs):
    while any(not j.sink.done.is_set() for j in jobs):
        sched.step()


def test_tokens_equal_generate_with_staggered_arrivals(engine):
    sampling = Sampling(temperature=0.8, top_k=20, seed=7)
    prompts = [list(range(5 + 3 * k, 25 + 7 * k)) for k in range(5)]
    solo = [engine.generate([p], max_new_tokens=6, sampling=sampling)[0].tokens for p in prompts]
    sched = Scheduler(engine, max_sessions=3, max_queue=8)
    jobs = [sched.add(_job(p, 6, sampling)) for p in prompts[:2]]
    sched.step()
    jobs += [sched.add(_job(p, 6, sampling)) for p in prompts[2:]]  # admitted at later step boundaries
    _drain(sched, jobs)
    assert [j.sink.tokens for j in jobs] == solo
    assert all(j.sink.reason == "length" for j in jobs)
    assert engine.sessions == []  # every session closed


def test_eos_retires_and_closes(engine):
    first = engine.generate([[3, 4, 5, 6]], max_new_tokens=3)[0].tokens
    sched = Scheduler(engine)
    job = sched.add(_job([3, 4, 5, 6], 10, eos=frozenset({first[1]})))
    _drain(sched, [job])
    assert job.sink.tokens == first[:1] and job.sink.reason == "stop"
    assert engine.sessions == []


def test_cancel_frees_the_session(engine):
    sched = Scheduler(engine)
    job = sched.add(_job(range(10, 30), 1000))
    for _ in range(4):
        sched.step()
    assert len(engine.sessions) == 1
    job.cancel()
    sched.step()
    assert job.sink.reason == "cancelled" and engine.sessions == []


def test_long_prompt_prefills_between_decodes(engine):
    """While a 10-chunk prompt prefills, the running stream gets a token every step."""
    sched = Scheduler(engine, max_sessions=4)
    running = sched.add(_job(range(5, 20), 1000))
    while not running.sink.tokens:
        sched.step()
    long = sched.add(_job(list(range(1, 161)), 2))
    before = len(running.sink.tokens)
    steps = 0
    while not long.sink.tokens:
        sched.step()
        steps += 1
    assert steps >= 10  # 160 tokens in chunks of 16
    assert len(running.sink.tokens) - before == steps  # one decode in every one of those steps
    running.cancel()
    _drain(sched, [long])
    sched.step()
    assert engine.sessions == []


def test_prompts_arriving_together_are_spread_over_the_steps_in_flight(engine):
    """8 prompts at once, 4 steps in flight: each step prefills 2 of them (a 1/depth share), so
    the first collected step brings 2 first tokens, not all 8 after one long step."""
    prompts = [list(range(40 + 9 * k, 44 + 9 * k)) for k in range(8)]  # 4 of them fit one chunk
    solo = [engine.generate([p], max_new_tokens=3)[0].tokens for p in prompts]
    sched = Scheduler(engine, max_sessions=8, depth=4)
    jobs = [sched.add(_job(p, 3)) for p in prompts]
    sched.step()
    assert sum(1 for j in jobs if j.sink.tokens) == 2
    for _ in range(3):
        sched.step()
    assert all(j.sink.tokens for j in jobs)  # the other three steps were in flight beside it
    _drain(sched, jobs)
    assert [j.sink.tokens for j in jobs] == solo
    assert engine.sessions == []


def test_full_queue_is_refused(engine):
    sched = Scheduler(engine, max_sessions=1, max_queue=2)
    for _ in range(3):  # one to run, two to wait
        sched.add(_job([1, 2], 1))
    with pytest.raises(QueueFull):
        sched.add(_job([1, 2], 1))


def test_a_failing_runner_ends_every_open_request(engine):
    class Broken:
        """The engine whose steps fail, as a pipeline does when recovery gives up."""
        def __getattr__(self, name):
            return getattr(engine, name)

        def collect(self, ticket):
            from engramflow.errors import EngramflowError
            engine.abandon()
            raise EngramflowError("giving up after 3 retries: stage died")

    sched = Scheduler(Broken())
    jobs = [sched.add(_job(range(1, 9), 5)) for _ in range(3)]
    sched.step()
    assert all(j.sink.error and "giving up" in j.sink.error for j in jobs)
    assert engine.sessions == [] and engine.outstanding == {}
    ok = sched.add(_job(range(1, 9), 2))  # the next request is served normally by a working runner
    sched.runner = engine
    _drain(sched, [ok])
    assert ok.sink.reason == "length"


def test_metrics_hear_load_and_engram_waits(engine, ray_session):
    """The scheduler reports its load and each step's exposed Engram wait to ServeMetrics (Ray's
    metrics API); its local view is what the gauges were last set to."""
    from engramflow.serve.metrics import ServeMetrics

    class Seen(ServeMetrics):
        def __init__(self):
            super().__init__()
            self.loads, self.waits = [], []

        def load(self, waiting, running, **rest):
            super().load(waiting, running)
            self.loads.append((waiting, running))

        def step(self, waits):
            super().step(waits)
            self.waits.append(waits)

    metrics = Seen()
    sched = Scheduler(engine, metrics=metrics)
    jobs = [sched.add(_job(range(1, 9), 3)) for _ in range(2)]
    _drain(sched, jobs)
    assert (0, 2) in metrics.loads and metrics.loads[-1] == (0, 0)
    assert metrics.waits and set(metrics.waits[0]) == set(engine.cfg.engram_layer_ids)
