"""The driver's session log is the one truth: an actor killed while a session is opened, forked,
reset or closed leaves every live session working (same logits as the in-process Engine), the
actors holding exactly the log's sessions, and later faults still recoverable."""
import zlib

import numpy as np
import pytest
import ray
import torch

from engramflow.actors.session_ops import apply_session_op, sync_sessions
from engramflow.errors import EngramflowError
from engramflow.memory.history import SessionHistory
from engramflow.pipeline.engine import Engine
from engramflow.pipeline.pipeline import Pipeline
from engramflow.pipeline.recovery import RecoveryPolicy

VOCAB_HI = 120_000


@pytest.fixture(scope="module")
def pipe(ray_session, tiny_ckpt):
    p = Pipeline.launch(tiny_ckpt, stages=2, policy=RecoveryPolicy(max_restarts=1000))  # many faults on purpose
    yield p
    p.shutdown()


@pytest.fixture(scope="module")
def engine(tiny_ckpt):
    return Engine(tiny_ckpt)


def _kill_and_wait(actor, timeout_s: float = 60.0) -> None:
    """ray.kill returns before the actor is gone: wait until it no longer answers, so the next
    call meets a dead actor (what the test is about), not one still finishing its queue."""
    import time

    ray.kill(actor, no_restart=True)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get(actor.__ray_ready__.remote(), timeout=5)
        except Exception:
            return
        time.sleep(0.05)
    raise AssertionError("the killed actor still answers")


def _kill_during(pipe, victim: str):
    """The next session op reaches every other stateful actor, then `victim` dies before it is
    sent there (a projection has no session state: it just dies, and the next step finds out)."""
    real = pipe._send_op

    def once(op, *args):
        pipe._send_op = real  # only this one send is disturbed
        others = [s.actor for n, s in pipe.slots.items() if s.stateful and n != victim]
        ray.get([a.session_op.remote(op, *args) for a in others])
        _kill_and_wait(pipe.actor(victim))
        return real(op, *args)

    pipe._send_op = once


class Mirror:
    """The same session operations on the pipeline and on an in-process Engine."""

    def __init__(self, pipe, engine, rng):
        self.pipe, self.engine, self.rng = pipe, engine, rng
        for s in list(engine.sessions):
            engine.close(s)
        for s in list(pipe.sessions):
            pipe.close(s)

    def open(self, name=None):
        s = self.pipe.open(name)
        self.engine.open(s)
        return s

    def fork(self, src):
        dst = self.pipe.fork(src)
        self.engine.fork(src, dst)
        return dst

    def reset(self, s):
        self.pipe.reset(s)
        self.engine.reset(s)

    def close(self, s):
        self.pipe.close(s)
        self.engine.close(s)

    def prefill(self, s, n=5):
        ids = self.rng.integers(3, VOCAB_HI, n).tolist()
        a, b = self.pipe.prefill(s, ids), self.engine.prefill(s, ids)
        assert torch.allclose(a, b, atol=1e-5)

    def check(self, kill: str | None = None):
        """Actors hold exactly the log's sessions; a decode step of every live session (a fault
        injected first, if `kill`) equals the Engine's."""
        live = self.pipe.sessions
        assert sorted(self.engine.sessions) == sorted(live)
        if kill is not None:
            _kill_and_wait(self.pipe.actor(kill))  # dead before the step: a step that ran first would pass it by
        if live:
            tokens = {s: int(self.rng.integers(3, VOCAB_HI)) for s in live}
            got, want = self.pipe.decode_step(tokens), self.engine.decode_step(tokens)
            for s in live:
                assert torch.allclose(got[s], want[s], atol=1e-5), s
                assert int(got[s].argmax()) == int(want[s].argmax())
        held = self.pipe.actor_sessions()
        assert all(sorted(names) == sorted(live) for names in held.values()), held
        lengths = sum(self.pipe.length(s) for s in live)
        assert all(st == {"live_sessions": len(live), "cached_positions": lengths} for st in self.pipe.stage_stats())


# (operation, actor killed while it runs, actor killed before the next step: a later fault)
CASES = [("close", "stage1", "history"),   # the reported case: the close reached the survivors
         ("close", "history", None),
         ("open", "stage0", None),
         ("fork", "history", "projection0"),
         ("reset", "stage1", None),
         ("reset", "projection0", "stage0")]


@pytest.mark.parametrize("op,victim,later", CASES)
def test_fault_during_a_session_op_leaves_every_session_working(pipe, engine, op, victim, later):
    m = Mirror(pipe, engine, np.random.default_rng(zlib.crc32(f"{op} {victim}".encode())))
    a, b, c = m.open(), m.open(), m.open()
    for s in (a, b, c):
        m.prefill(s, 4 + len(s))
    m.check()
    restarts = pipe.recovery.restarts
    _kill_during(pipe, victim)
    if op == "open":
        new = m.open()
        m.prefill(new)
    elif op == "fork":
        new = m.fork(b)
        m.prefill(new, 3)
    elif op == "reset":
        m.reset(b)
        m.prefill(b, 6)
    else:
        m.close(b)
    m.check()
    assert pipe.recovery.restarts == restarts + 1 and pipe.recovery.events[-1]["dead"] == [victim]
    m.check(kill=later)  # a later fault still recovers
    assert pipe.recovery.restarts == restarts + 1 + (later is not None)
    for s in list(pipe.sessions):
        m.close(s)
    m.check()


def test_fault_during_recovery_replays_again(pipe, engine):
    m = Mirror(pipe, engine, np.random.default_rng(7))
    a, b = m.open(), m.open()
    m.prefill(a, 9)
    m.prefill(b, 3)
    real_sync = pipe.recovery.sync
    calls = []

    def sync_with_a_fault():
        calls.append(1)
        if len(calls) == 1:  # the first replay loses a stage actor part-way
            pipe.recovery.sync = real_sync
            names = list(pipe.session_logs)
            ray.get([s.actor.sync_sessions.remote(names) for s in pipe.slots.values() if s.stateful])
            _kill_and_wait(pipe.actor("stage0"))
        return real_sync()

    pipe.recovery.sync = sync_with_a_fault
    _kill_during(pipe, "history")
    m.close(a)
    assert calls and pipe.recovery.sync == real_sync
    m.check()
    m.close(b)
    m.check()


def test_a_failed_session_op_rolls_the_log_back_and_resyncs(pipe, engine):
    """Retries exhausted: open/fork/reset leave the log as it was, close still ends the session;
    the actors follow the log at the next call."""
    m = Mirror(pipe, engine, np.random.default_rng(3))
    a = m.open()
    m.prefill(a, 6)
    real = pipe._send_op

    def always_fails(op, *args):
        real(op, *args)  # every actor applies it ...
        raise ray.exceptions.GetTimeoutError("injected")  # ... but the driver never hears back

    old = pipe.policy.max_retries
    pipe.policy.max_retries = 1
    pipe._send_op = always_fails
    try:
        with pytest.raises(EngramflowError, match="giving up"):
            pipe.fork(a, "forked")
        with pytest.raises(EngramflowError, match="giving up"):
            pipe.reset(a)
        with pytest.raises(EngramflowError, match="giving up"):
            pipe.open("opened")
    finally:
        pipe._send_op = real
        pipe.policy.max_retries = old
    assert pipe.sessions == [a] and pipe.length(a) == 6
    m.check()  # the actors were reconciled: a is whole again, "forked" and "opened" are gone
    pipe._send_op = always_fails
    pipe.policy.max_retries = 0
    try:
        with pytest.raises(EngramflowError, match="giving up"):
            pipe.close(a)
    finally:
        pipe._send_op = real
        pipe.policy.max_retries = old
    engine.close(a)
    assert pipe.sessions == []
    pipe.encode("any call")  # the next call reconciles the actors to the log first
    m.check()


def test_session_ops_are_idempotent_and_sync_matches_the_log(tiny_ckpt):
    from engramflow.io.checkpoint import Checkpoint

    h = SessionHistory.from_checkpoint(Checkpoint(tiny_ckpt))
    has = lambda s: s in h.sessions  # noqa: E731
    for _ in range(2):
        apply_session_op(h, has, "open", ("a",))
    h.append("a", [5, 6, 7])
    for _ in range(2):
        apply_session_op(h, has, "fork", ("a", "b"))
    assert h.length("b") == 3
    for _ in range(2):
        apply_session_op(h, has, "reset", ("a",))
        apply_session_op(h, has, "close", ("b",))
    assert h.sessions == ["a"] and h.length("a") == 0
    apply_session_op(h, has, "open", ("c",))
    h.append("c", [1, 2])
    out = sync_sessions(h, h.sessions, ["c", "d"])
    assert out == {"closed": ["a"], "opened": ["d"]}
    assert sorted(h.sessions) == ["c", "d"] and h.length("c") == 0
    with pytest.raises(ValueError):
        apply_session_op(h, has, "rename", ("c",))


def test_staging_pool_is_bounded():
    from engramflow.actors.staging import PinnedStaging

    st = PinnedStaging(torch.device("cpu"), max_buffers=3, max_bytes=1000)
    for n in range(6):  # the eviction itself, without a GPU: least recently used go first
        st._buffers[(n,)] = (torch.zeros(10, dtype=torch.float32), None)
        st._evict(keep=(n,))
    assert list(st._buffers) == [(3,), (4,), (5,)] and st.pinned_bytes == 120
    st._buffers[(9,)] = (torch.zeros(200, dtype=torch.float32), None)  # 800 bytes: over the byte bound
    st._evict(keep=(9,))
    assert list(st._buffers) == [(4,), (5,), (9,)]  # the count bound
    st._buffers[(10,)] = (torch.zeros(200, dtype=torch.float32), None)
    st._evict(keep=(10,))
    assert list(st._buffers) == [(10,)] and st.pinned_bytes == 800  # the byte bound
    st.clear()
    assert st.pinned_bytes == 0


def test_actors_report_memory_and_hold_nothing_after_every_session_closes(pipe):
    for s in list(pipe.sessions):
        pipe.close(s)
    names = [pipe.open() for _ in range(3)]
    for s in names:
        pipe.prefill(s, list(range(5, 5 + 40)))
    mem = pipe.memory()
    assert set(mem) == {"history", "stage0", "stage1"}
    assert all(m["rss_bytes"] > 0 and m["live_sessions"] == 3 for m in mem.values())
    # the constructor froze the startup heap: a full collection after a close skips it
    assert all(m["frozen_objects"] > 10_000 for m in mem.values())
    for s in names:
        pipe.close(s)
    mem = pipe.memory()
    assert all(m["live_sessions"] == 0 for m in mem.values())
    assert all(m.get("pinned_bytes", 0) == 0 for m in mem.values())
    assert all(st == {"live_sessions": 0, "cached_positions": 0} for st in pipe.stage_stats())
