"""Images through the Ray pipeline: the same tokens and logits as the in-process Engine with 1 and
3 stages, forks of a session holding an image, a rollback into an image span, and a stage killed
mid-run (its replacement encodes the images again from the driver's log and replays)."""
import pytest
import ray
import torch

from engramflow.pipeline.engine import Engine
from engramflow.pipeline.pipeline import Pipeline
from engramflow.pipeline.step import Request
from v41_vision_golden import IMAGES, PROMPT_IMAGES, V41_VISION, vision_golden

pytestmark = pytest.mark.default_threads  # golden bits: torch's default thread count (conftest.py)


@pytest.fixture(scope="module")
def engine():
    e = Engine(V41_VISION)
    yield e
    e.shutdown()


@pytest.fixture(scope="module", params=[1, 3])
def pipe(request, ray_session):
    p = Pipeline.launch(V41_VISION, stages=request.param)
    yield p
    p.shutdown()


@pytest.fixture(scope="module")
def gold():
    return vision_golden()


def case(gold, name):
    return gold[f"prompt.{name}"].tolist(), [IMAGES / n for n in PROMPT_IMAGES[name]]


def test_generate_equals_engine(pipe, engine, gold):
    prompts, images = zip(*(case(gold, n) for n in ("two_images", "one_image")))
    want = engine.generate(list(prompts), max_new_tokens=6, images=list(images))
    got = pipe.generate(list(prompts), max_new_tokens=6, images=list(images))
    assert [g.tokens for g in got] == [w.tokens for w in want]
    assert [g.prompt_ids for g in got] == [w.prompt_ids for w in want] == [list(p) for p in prompts]


def test_fork_with_an_image_and_a_stage_killed_mid_run(pipe, engine, gold):
    prompt, images = case(gold, "mid_conversation")
    p, e = pipe.open(), engine.open()
    assert torch.equal(pipe.prefill(p, prompt, images=images), engine.prefill(e, prompt, images=images))
    pf, ef = pipe.fork(p), engine.fork(e)
    for t in (5, 9):
        got, want = pipe.decode_step({p: t, pf: t + 1}), engine.decode_step({e: t, ef: t + 1})
        assert torch.equal(got[p], want[e]) and torch.equal(got[pf], want[ef])
    restarts = pipe.recovery.restarts
    ray.kill(pipe.actor("stage0"), no_restart=True)  # the stage that also runs the vision tower
    got, want = pipe.decode_step({p: 11, pf: 12}), engine.decode_step({e: 11, ef: 12})
    assert pipe.recovery.restarts == restarts + 1
    assert torch.equal(got[p], want[e]) and torch.equal(got[pf], want[ef])
    for s in (p, pf):
        pipe.close(s)
    engine.close(e), engine.close(ef)


def test_rollback_into_an_image_span_then_replay(pipe, engine, gold):
    """A write inside an image span cuts the span. After a fault the pipeline replays the log: the
    cut segment carries only the rows of the span left, from the image encoded again. It equals an
    Engine session written with the same segments (its log's), step for step."""
    prompt, images = case(gold, "one_image")
    p, e = pipe.open(), engine.open()
    pipe.prefill(p, prompt, images=images)
    engine.prefill(e, prompt, images=images)
    cut = 6 + 4  # six text tokens, then four positions into the span
    assert torch.equal(pipe.prefill(p, [1, 2, 3], start_pos=cut), engine.prefill(e, [1, 2, 3], start_pos=cut))
    segments = engine.segments(e)
    assert [s.ids.size for s in segments] == [cut, 3] and segments[0].images[0].n == 4
    ray.kill(pipe.actor("stage0"), no_restart=True)  # replay: image encoded again, rows clipped
    replayed = engine.open()
    for seg in segments:
        engine.collect(engine.submit([Request(replayed, seg.ids, seg.start_pos, seg.dead, images=seg.images)]))
    assert torch.equal(pipe.decode_step({p: 4})[p], engine.decode_step({replayed: 4})[replayed])
    pipe.close(p), engine.close(e), engine.close(replayed)


@pytest.mark.parametrize("stages", [None, 2])  # None: the in-process Engine
def test_speculative_with_an_image_equals_plain_greedy(ray_session, engine, gold, stages):
    """The prompt's image rows are written by the prefill; draft blocks after it are text, verified
    and rolled back as usual; row-by-row verification (`:exact`) gives plain greedy's tokens."""
    prompt, images = case(gold, "one_image")
    want = engine.generate([prompt], max_new_tokens=10, images=[images])[0].tokens
    spec = (Engine(V41_VISION, speculative="dspark:exact") if stages is None
            else Pipeline.launch(V41_VISION, stages=stages, speculative="dspark:exact"))
    try:
        (g,) = spec.generate([prompt], max_new_tokens=10, images=[images])
        assert g.tokens == want
        assert spec.speculative_stats.drafted > 0
    finally:
        spec.shutdown()
