"""Kept actor processes (pipeline/actor_pool.py) on the session's real Ray: a shut-down
pipeline's stage and history actors serve the next launch, re-initialised with its arguments
(another checkpoint, another stage count) and generating what fresh actors generate; nothing of
the old state survives; an actor that holds resources, or one past the limit, is ended; one
whose constructor refuses the new arguments is replaced by a fresh actor reporting the error;
a kept actor waits parked (blocked in a call) until it is handed out, a threaded one too, and
clearing the pool ends it and the gate."""
import os
import time

import pytest
import ray

from actor_gone import gone
from conftest import KEPT_ACTORS
from engramflow.actors.init_guard import keep_init_error
from engramflow.errors import EngramflowError
from engramflow.pipeline import actor_pool
from engramflow.pipeline.engine import Engine
from engramflow.pipeline.pipeline import Pipeline


@ray.remote
@keep_init_error
class Echo:
    def __init__(self, value: str):
        if value == "bad":
            raise EngramflowError(f"refused value {value!r}")
        self.value = value

    def set_extra(self) -> None:
        self.extra = 1

    def get(self) -> tuple:
        return self.value, hasattr(self, "extra"), os.getpid()


@pytest.fixture
def pool(ray_session):
    actor_pool.keep_idle(0)  # start empty: what earlier tests left is ended
    actor_pool.keep_idle(KEPT_ACTORS)
    yield actor_pool
    actor_pool.keep_idle(0)
    actor_pool.keep_idle(KEPT_ACTORS)


def test_a_kept_actor_is_re_initialised_with_nothing_of_its_old_state(pool):
    first = pool.make(Echo, {"num_cpus": 0}, "a")
    ray.get(first.set_extra.remote())
    _, extra, pid = ray.get(first.get.remote())
    assert extra
    pool.release([first])
    second = pool.make(Echo, {"num_cpus": 0}, "b")
    assert ray.get(second.get.remote()) == ("b", False, pid)  # the same process, a new object
    other = pool.make(Echo, {"num_cpus": 0, "max_concurrency": 2}, "c")  # other options: its own process
    assert ray.get(other.get.remote())[2] != pid
    pool.release([second, other])


def _cpu_s(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_a_kept_actor_waits_parked_until_handed_out(pool):
    first = pool.make(Echo, {"num_cpus": 0}, "a")
    pid = ray.get(first.get.remote())[2]
    pool.release([first])
    ready = first.__ray_ready__.remote()
    assert ray.wait([ready], timeout=3)[0] == []  # blocked in park: a call waits behind it
    before = _cpu_s(pid)
    time.sleep(2)
    print(f"a parked actor's process: {(_cpu_s(pid) - before) / 2 * 100:.1f} % of a core")
    again = pool.make(Echo, {"num_cpus": 0}, "b")
    assert again._actor_id == first._actor_id and ray.get(again.get.remote(), timeout=60) == ("b", False, pid)
    pool.release([again])
    gate = actor_pool._gate
    pool.keep_idle(0)  # clear: the kept actor and the gate end
    assert gone(again) and gone(gate)


def test_a_threaded_actor_parks_and_a_quick_hand_out_keeps_its_new_state(pool):
    """A threaded actor answers calls while parked (its state dropped: only `init_error`
    works), and Ray may run its `reinit` before its `park`: handed out again at once, it keeps
    the new state whichever ran first (init_guard's lock and the gate's `taken`)."""
    threaded = {"num_cpus": 0, "max_concurrency": 2}
    first = pool.make(Echo, threaded, "t")
    pid = ray.get(first.get.remote())[2]
    pool.release([first])
    deadline = time.monotonic() + 60
    while ray.get(first.init_error.remote()) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ray.get(first.init_error.remote()) == "a parked actor: re-initialise it before use"
    again = pool.make(Echo, threaded, "u")
    assert again._actor_id == first._actor_id and ray.get(again.get.remote(), timeout=60) == ("u", False, pid)
    for value in ("v", "w", "x"):
        pool.release([again])
        again = pool.make(Echo, threaded, value)  # at once: `park` may not have run yet
        time.sleep(0.5)  # a late `park` would have dropped the new state by now
        assert ray.get(again.get.remote(), timeout=60) == (value, False, pid)
    pool.release([again])
    pool.keep_idle(0)
    assert gone(again)


@keep_init_error
class PlainEcho:
    def __init__(self, value: str):
        self.value = value


def test_a_park_that_comes_after_its_reinit_leaves_the_new_state(ray_session):
    """Ray may run a threaded actor's `reinit` before its `park` (the order the pool sent them
    in): `park` then finds its token open at the gate and returns, the new state untouched; in
    the usual order it drops the state and waits for the token. (The object in this process,
    the gate a real actor.)"""
    import threading

    gate = actor_pool.Gate.remote()
    echo = PlainEcho("old")
    ray.get(gate.open.remote("late"))  # the pool hands the actor out: the token opens, then `reinit`
    echo.reinit("new")
    echo.park(gate, "late")  # returns at once
    assert echo.value == "new" and echo.init_error() is None
    waiting = threading.Thread(target=echo.park, args=(gate, "usual"))
    waiting.start()
    waiting.join(timeout=2)
    assert waiting.is_alive() and not hasattr(echo, "value")  # dropped, and waiting for its token
    ray.get(gate.open.remote("usual"))
    waiting.join(timeout=60)
    assert not waiting.is_alive()
    echo.reinit("next")
    assert echo.value == "next" and ray.get(gate.taken.remote("late")) is False  # no token left behind
    ray.kill(gate)


def test_a_refused_re_initialisation_gives_a_fresh_actor_with_the_error(pool):
    kept = pool.make(Echo, {"num_cpus": 0}, "a")
    pool.release([kept])
    fresh = pool.make(Echo, {"num_cpus": 0}, "bad")
    assert ray.get(fresh.init_error.remote()) == "refused value 'bad'"
    assert fresh._actor_id != kept._actor_id and gone(kept)
    pool.release([fresh])


def test_actors_holding_cpus_and_those_past_the_limit_are_ended(pool):
    holds = pool.make(Echo, {"num_cpus": 1}, "a")
    pool.release([holds])
    assert gone(holds)
    pool.keep_idle(2)  # any limit: a small one starts fewer processes
    made = [pool.make(Echo, {"num_cpus": 0}, str(i)) for i in range(3)]
    first_pid = ray.get(made[0].get.remote())[2]
    pool.release(made)
    assert gone(made[-1]) and os.path.exists(f"/proc/{first_pid}")  # kept (parked: it answers no call)


def test_pipelines_share_kept_actors_and_generate_what_fresh_ones_do(ray_session, tiny_ckpt, v41_small_preset):
    """(The actors of earlier tests may serve the first launch: it is checked against the Engine too.)"""
    prompt = [5, 6, 7, 8]
    first = Pipeline.launch(tiny_ckpt, stages=2)
    (want_tiny,) = first.generate([prompt], max_new_tokens=6)
    ids = {a._actor_id for a in first.actors()}
    first.shutdown()
    second = Pipeline.launch(v41_small_preset, stages=3)  # another model, another cut, 2 of 3 stages kept
    stage_ids = {a._actor_id for a in second.stage_actors}
    assert len(stage_ids & ids) == 2 and second.history_actor._actor_id in ids
    (got_v41,) = second.generate([prompt], max_new_tokens=6)
    second.shutdown()
    assert want_tiny.tokens == Engine(tiny_ckpt).generate([prompt], max_new_tokens=6)[0].tokens
    engine = Engine(v41_small_preset)
    assert got_v41.tokens == engine.generate([prompt], max_new_tokens=6)[0].tokens
    engine.shutdown()
