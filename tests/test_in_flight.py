"""Steps in flight: groups of sessions each with one step in flight give the
Engine's tokens; sessions open, finish and fork while other steps are in flight; a stage
killed mid-flight is replayed; the stages are busy at once; Pick and the wire format are exact."""
import numpy as np
import pytest
import ray
import torch

from engramflow.errors import EngramflowError
from engramflow.model.sampling import Pick, Sampling
from engramflow.model.stage_batch import from_wire, to_wire
from engramflow.pipeline.engine import Engine
from engramflow.pipeline.in_flight import check_in_flight
from engramflow.pipeline.pipeline import Pipeline

PROMPTS = ["Engram memory lets a model look things up", "The quick brown fox", "Ray actors overlap work",
           "Tables stay in host memory", "A fifth prompt, longer than the others, so groups differ", "six"]
NEW = 6
SAMPLED = Sampling(temperature=0.9, top_k=50, seed=11)


@pytest.fixture(scope="module")
def engine(tiny_ckpt):
    return Engine(tiny_ckpt)


@pytest.fixture(scope="module")
def pipes(tiny_pipelines):
    """stages -> the session's pipeline on the tiny checkpoint (a kill test's recovery leaves it
    whole, with a new actor in the dead one's place)."""
    return tiny_pipelines


@pytest.fixture(scope="module")
def want(engine):
    """The Engine's tokens with every session in one group (greedy, seeded sampling)."""
    return {s: [g.tokens for g in engine.generate(PROMPTS, NEW, sampling=s, in_flight=1)]
            for s in (Sampling(), SAMPLED)}


@pytest.mark.parametrize("depth", [2, 3, 6])
def test_engine_tokens_do_not_depend_on_groups(engine, want, depth):
    for s, tokens in want.items():
        assert [g.tokens for g in engine.generate(PROMPTS, NEW, sampling=s, in_flight=depth)] == tokens


@pytest.mark.parametrize("stages", [1, 2, 3])
def test_pipeline_groups_in_flight_equal_the_engine(pipes, want, stages):
    pipe = pipes(stages)
    assert pipe.in_flight_default == stages
    for depth in sorted({1, stages, stages + 1}):
        for s, tokens in want.items():
            got = pipe.generate(PROMPTS, NEW, sampling=s, in_flight=depth)
            assert [g.tokens for g in got] == tokens, (stages, depth, s)
    assert pipe.sessions == [] and pipe.outstanding == {}
    assert all(v == [] for v in pipe.actor_sessions().values())


def run_lanes(runner, lanes):
    """A hand-made schedule (the scheduler decides its own): each lane yields a step and is sent
    its result; every lane has a step in flight, collected oldest first."""
    queue = []
    lanes = list(lanes)
    for lane in lanes:
        queue.append((runner.submit(next(lane)), lane))
    while queue:
        ticket, lane = queue.pop(0)
        try:
            queue.append((runner.submit(lane.send(runner.collect(ticket))), lane))
        except StopIteration:
            pass


def _script(runner, kill=None):
    """Sessions that open, finish and fork while other steps are in flight, driven by hand:
    group A decodes 6 steps, group B 3 steps and then closes; when B finishes, a new session
    C opens and prefills and a fork D of B's first session is made, both while A's step is
    in flight. Returns every logits tensor received, by session and step."""
    ids = {name: runner.encode(p) for name, p in zip("ABCD", PROMPTS)}
    got: dict[str, list] = {}
    sessions = {"A": [runner.open(), runner.open()], "B": [runner.open()]}
    for group, names in sessions.items():
        for s in names:
            got[s] = [runner.prefill(s, ids[group])]
    collected = [0]

    def decode(group, steps):  # a lane: `steps` lockstep decode steps of a group
        for _ in range(steps):
            result = yield [runner.request(s, [int(got[s][-1].argmax())]) for s in sessions[group]]
            collected[0] += 1
            if kill is not None and collected[0] == 2:
                ray.kill(runner.actor(kill), no_restart=True)  # the other group's step is in flight
            for s, lg in zip(sessions[group], result.logits):
                got[s].append(lg)

    def b_then_c():  # B is done: fork it, close it, and start C -- while A is in flight
        yield from decode("B", 3)
        assert runner.outstanding  # A's step really is in flight
        b = sessions["B"][0]
        d = runner.fork(b)
        got[d] = list(got[b])
        runner.close(b)
        c = runner.open()
        (chunk,) = runner.prefill_requests(c, ids["C"])
        result = yield [chunk]
        got[c] = [result.logits[0]]
        sessions["C"] = [c, d]
        yield from decode("C", 2)

    run_lanes(runner, [decode("A", 6), b_then_c()])
    for s in list(runner.sessions):
        runner.close(s)
    return list(got.values())


@pytest.fixture(scope="module")
def scripted(engine):
    return _script(engine)


def test_sessions_open_finish_and_fork_while_steps_are_in_flight(pipes, scripted):
    pipe = pipes(2)
    got = _script(pipe)
    assert [len(x) for x in got] == [len(x) for x in scripted]
    for g, w in zip(got, scripted):
        for a, b in zip(g, w):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
            assert int(a.argmax()) == int(b.argmax())
    assert pipe.actor_sessions() == {"history": [], "stage0": [], "stage1": []}


@pytest.mark.parametrize("victim", ["stage1", "projection0"])
def test_an_actor_killed_mid_flight_is_replayed(pipes, scripted, victim):
    pipe = pipes(2)
    restarts = pipe.recovery.restarts
    got = _script(pipe, kill=victim)
    assert pipe.recovery.restarts == restarts + 1 and pipe.recovery.events[-1]["dead"] == [victim]
    for g, w in zip(got, scripted):
        assert [int(a.argmax()) for a in g] == [int(b.argmax()) for b in w]
        for a, b in zip(g, w):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.timing
def test_stages_are_busy_at_once(ray_session, tiny_ckpt):
    """Emulated backbone (blocks sleep like a GPU): with 2 groups in flight on 2 stages, both
    stages' block spans overlap in time; with 1 group they never do."""
    pipe = Pipeline.launch(tiny_ckpt, stages=2, backbone="emulated", block_ms=4.0)
    try:
        overlap = {}
        for depth in (1, 2):
            pipe.drain_spans()
            pipe.generate(PROMPTS[:4], 6, in_flight=depth)
            spans = [s for s in pipe.drain_spans() if s["name"].startswith("block ")]
            by_stage = {}
            for s in spans:
                by_stage.setdefault(s["track"], []).append((s["start_ns"], s["end_ns"]))
            (a, b) = by_stage.values()
            overlap[depth] = sum(max(0, min(e0, e1) - max(s0, s1)) for s0, e0 in a for s1, e1 in b) / 1e6
        assert overlap[1] == 0.0
        assert overlap[2] > 10 * 4.0  # ms of both stages computing at once: well over a few blocks
    finally:
        pipe.shutdown()


def test_in_flight_checks(engine):
    for bad in (0, -1, 65, 1.5, True, "2"):
        with pytest.raises(EngramflowError, match="steps in flight must be an integer"):
            check_in_flight(bad)
        with pytest.raises(EngramflowError, match="steps in flight must be an integer"):
            engine.generate(["x"], 2, in_flight=bad)
    s = engine.open()
    t = engine.submit([engine.request(s, [5, 6])])
    with pytest.raises(EngramflowError, match="already has a step in flight"):
        engine.submit([engine.request(s, [7])])
    for op in (engine.close, engine.reset, engine.fork):
        with pytest.raises(EngramflowError, match="has a step in flight"):
            op(s)
    assert engine.length(s) == 0  # not collected: not in the log
    engine.collect(t)
    assert engine.length(s) == 2
    with pytest.raises(EngramflowError, match="not in flight"):
        engine.collect(t)
    engine.close(s)


def test_abandoned_steps_never_enter_the_log(engine):
    s = engine.open()
    engine.prefill(s, [5, 6, 7])
    want = engine.decode_step({s: 8})[s]
    engine.reset(s)
    engine.prefill(s, [5, 6, 7])
    engine.submit([engine.request(s, [9, 9, 9])])
    engine.abandon()
    assert engine.outstanding == {} and engine.length(s) == 3
    torch.testing.assert_close(engine.decode_step({s: 8})[s], want, rtol=0, atol=0)
    engine.close(s)


def test_pick_matches_float64_reference_and_is_keyed_by_stream_and_step():
    seed = int(np.random.SeedSequence().entropy % 2**32)
    logits = torch.randn(5000, generator=torch.Generator().manual_seed(seed)) * 4
    p = Pick(logprobs=7)(logits)
    ref = torch.log_softmax(logits.double(), dim=-1)
    assert p.token == int(torch.argmax(logits)), seed
    assert p.logprob == pytest.approx(float(ref[p.token]), abs=1e-5), seed
    # the top-k by the float64 reference; a near-tie may order two tokens either way in fp32
    np.testing.assert_allclose(p.top_logprobs, torch.topk(ref, 7).values.numpy(), atol=1e-5, err_msg=str(seed))
    np.testing.assert_allclose([float(ref[t]) for t in p.top_tokens], p.top_logprobs, atol=1e-5, err_msg=str(seed))
    logits = logits / 4  # a flatter distribution, so that different keys visibly draw differently
    draws = {(stream, step): Pick(SAMPLED, stream, step)(logits).token for stream in range(4) for step in range(30)}
    again = {(stream, step): Pick(SAMPLED, stream, step)(logits).token for stream in range(4) for step in range(30)}
    assert draws == again  # no hidden state: the same key, the same draw
    assert len(set(draws.values())) > 10  # different keys draw differently


def test_wire_round_trip_is_exact():
    g = torch.Generator().manual_seed(3)
    x = {"h": torch.randn(5, 4, 8, generator=g).to(torch.bfloat16), "f": torch.randn(3, generator=g),
         "pair": (torch.arange(4), [torch.ones(2, dtype=torch.float64)]), "n": 7}
    wire = to_wire(x)
    assert not any(isinstance(v, torch.Tensor) for v in (wire["h"], wire["f"]))
    back = from_wire(ray.cloudpickle.loads(ray.cloudpickle.dumps(wire)))
    assert back["h"].dtype == torch.bfloat16 and torch.equal(back["h"], x["h"])
    assert torch.equal(back["f"], x["f"]) and torch.equal(back["pair"][0], x["pair"][0])
    assert back["pair"][1][0].dtype == torch.float64 and back["n"] == 7
