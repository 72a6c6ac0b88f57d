"""The Ray pipeline against the in-process Engine: same tokens, logits within 1e-5."""
import pytest
import torch

from engramflow.errors import EngramflowError
from engramflow.pipeline.engine import Engine
from engramflow.model.sampling import Sampling

PROMPTS = ["Engram memory lets a model look things up", "The quick brown fox", "Ray actors overlap work"]


@pytest.fixture(scope="module")
def engine(tiny_ckpt):
    return Engine(tiny_ckpt)


@pytest.fixture(scope="module", params=[1, 2, 3], ids=lambda k: f"{k}-stages")
def pipeline(request, tiny_pipelines):
    return tiny_pipelines(request.param)


def close(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape
    assert torch.allclose(a, b, rtol=0, atol=1e-5 * max(1.0, float(b.abs().max()))), float((a - b).abs().max())


def both(pipeline, engine, fn):
    """Run the same script on both runners; returns the two results."""
    return fn(pipeline), fn(engine)


def test_one_session_generates_the_same_tokens(pipeline, engine):
    got, ref = both(pipeline, engine, lambda r: r.generate([PROMPTS[0]], max_new_tokens=6))
    assert got[0].tokens == ref[0].tokens and len(got[0].tokens) == 6
    assert got[0].text == ref[0].text
    assert set(got[0].exposed_wait_ms) == {1, 14}


def test_seeded_sampling_is_reproducible(pipeline, engine):
    s = Sampling(temperature=0.8, top_k=50, seed=7)
    got, ref = both(pipeline, engine, lambda r: r.generate(PROMPTS[:2], max_new_tokens=5, sampling=s))
    assert [g.tokens for g in got] == [g.tokens for g in ref]


def test_three_interleaved_sessions(pipeline, engine):
    def script(r):
        names = [r.open() for _ in PROMPTS]
        logits = [r.prefill(s, r.encode(p)) for s, p in zip(names, PROMPTS)]
        trace = [torch.stack(logits)]
        for _ in range(4):
            nxt = {s: int(lg.argmax()) for s, lg in zip(names, logits)}
            out = r.decode_step(nxt)
            logits = [out[s] for s in names]
            trace.append(torch.stack(logits))
        for s in names:
            r.close(s)
        return trace

    got, ref = both(pipeline, engine, script)
    for a, b in zip(got, ref):
        close(a, b)
        assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_a_sessions_logits_come_alone(pipeline):
    """Each session's logits are its own row, not a view of the step's rows: pickled, a view
    carries its whole storage, so every session's row would travel (and be kept) N times."""
    names = [pipeline.open() for _ in PROMPTS]
    for s, p in zip(names, PROMPTS):
        pipeline.prefill(s, pipeline.encode(p))
    out = pipeline.decode_step({s: 5 for s in names})
    for s in names:
        assert out[s].untyped_storage().nbytes() == out[s].numel() * out[s].element_size()
        pipeline.close(s)


def test_image_span_fork_and_reset(pipeline, engine):
    ids = list(range(1000, 1012))

    def script(r):
        s = r.open()
        out = [r.prefill(s, ids, image_spans=[(3, 7)])]
        child = r.fork(s)
        out.append(r.decode_step({s: 11, child: 22})[child])
        out.append(r.decode_step({s: 33})[s])
        r.reset(s)
        out.append(r.prefill(s, ids[:5]))
        out.append(r.prefill(child, [44, 55], start_pos=5))  # rollback inside the fork
        assert r.length(child) == 7
        r.close(s)
        r.close(child)
        return out

    got, ref = both(pipeline, engine, script)
    for a, b in zip(got, ref):
        close(a, b)


def test_image_span_changes_the_answer(engine):
    s = engine.open()
    plain = engine.prefill(s, list(range(1000, 1012)))
    engine.reset(s)
    masked = engine.prefill(s, list(range(1000, 1012)), image_spans=[(3, 7)])
    engine.close(s)
    assert not torch.equal(plain, masked)


@pytest.mark.parametrize("call,match", [
    (lambda p: p.prefill("ghost", [1, 2]), "unknown session 'ghost'"),
    (lambda p: p.generate([""], 3), "empty prompt"),
    (lambda p: p.generate([[1, 2, 129_280]], 3), "token id 129280"),
    (lambda p: p.generate([[1, 2.5]], 3), "must be integers"),
    (lambda p: p.generate([[1] * 5000], 3), "max_seq_len=4096"),
    (lambda p: p.generate([[1, 2, 3]], 2, image_spans=[[(2, 9)]]), "outside the prompt"),
])
def test_bad_input_is_refused_and_the_pipeline_stays_usable(pipeline, engine, call, match):
    before = list(pipeline.sessions)
    with pytest.raises(EngramflowError, match=match):
        call(pipeline)
    assert pipeline.sessions == before
    assert all(st["live_sessions"] == len(before) for st in pipeline.stage_stats())
    got, ref = both(pipeline, engine, lambda r: r.generate([PROMPTS[1]], max_new_tokens=2))
    assert got[0].tokens == ref[0].tokens


def test_closed_sessions_release_memory(pipeline):
    names = [pipeline.open() for _ in range(3)]
    for s in names:
        pipeline.prefill(s, [5, 6, 7, 8])
    assert all(st["cached_positions"] == 12 for st in pipeline.stage_stats())
    for s in names:
        pipeline.close(s)
    assert all(st == {"live_sessions": 0, "cached_positions": 0} for st in pipeline.stage_stats())
    with pytest.raises(EngramflowError, match="unknown session"):
        pipeline.close(names[0])
