"""One forward per step, batch- and chunk-invariant by default: a session's logits are the same
bits whether it runs alone, in a step with 1, 4 or 16 other sessions (their prefill chunks and
decodes mixed in), or with its prompt prefilled in chunks of 7, 64 or all at once; on the
in-process Engine and on a 2-stage Ray pipeline; with an image in the prompt; and DSpark
speculative decoding without `:exact` then gives plain greedy decoding's tokens.
"""
import numpy as np
import pytest
import ray
import torch

from engramflow.kernels import sum_order
from engramflow.pipeline.engine import Engine
from engramflow.pipeline.pipeline import Pipeline
from engramflow.pipeline.step import Request
from v41_golden import V41_SMALL
from v41_vision_golden import IMAGES, PROMPT_IMAGES, V41_VISION, vision_golden

pytestmark = pytest.mark.default_threads  # golden bits: torch's default thread count (conftest.py)

DECODES = 3
LENGTHS = (3, 17, 45, 90, 120)  # short of the window, past it, past index_topk compressed rows


@pytest.fixture(scope="module")
def engine():
    e = Engine(V41_SMALL)
    assert e.numerics == "batched" and e.stage.numerics == "batched"  # the default
    yield e
    e.shutdown()


@pytest.fixture(scope="module")
def prompts():
    g = np.random.default_rng(7)
    return [g.integers(3, 500, n).tolist() for n in LENGTHS]


def drive(runner, prompts: list, chunk: int, images: list | None = None) -> list[list[torch.Tensor]]:
    """Prefill every prompt `chunk` tokens per step (0: all at once) and decode DECODES greedy
    tokens, all the sessions in the same steps (a session's prefill chunks share steps with the
    others' decodes once those are ahead). Per session: its logits after the prompt, then after
    each decoded token."""
    sessions = [runner.open() for _ in prompts]
    saved, runner.prefill_chunk = runner.prefill_chunk, chunk or runner.cfg.max_seq_len
    try:
        chunks = [runner.prefill_requests(s, p, images=None if images is None else images[i])
                  for i, (s, p) in enumerate(zip(sessions, prompts))]
    finally:
        runner.prefill_chunk = saved
    written = [sum(r.ids.size for r in c) for c in chunks]  # an image placeholder becomes its span
    logits: list[list[torch.Tensor]] = [[] for _ in prompts]
    try:
        while any(len(out) < DECODES + 1 for out in logits):
            step, owners = [], []
            for i, s in enumerate(sessions):
                if chunks[i]:
                    step.append(chunks[i].pop(0))
                elif len(logits[i]) < DECODES + 1:
                    step.append(runner.request(s, [int(logits[i][-1].argmax())]))
                else:
                    continue
                owners.append(i)
            result = runner.collect(runner.submit(step))
            for i, out in zip(owners, result.logits):
                if runner.length(sessions[i]) >= written[i]:  # the prompt's last chunk, or a decode
                    logits[i].append(out)
    finally:
        for s in sessions:
            runner.close(s)
    return logits


def assert_same(got: list[torch.Tensor], want: list[torch.Tensor], what: str) -> None:
    assert len(got) == len(want) == DECODES + 1, what
    for k, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"{what}: logits {k} differ by up to {float((a - b).abs().max())}"


def with_company(prompts: list, target: int, others: int, seed: int) -> tuple[list, int]:
    """The target prompt among `others` random ones of other lengths; its index in the list."""
    g = np.random.default_rng(seed)
    extra = [g.integers(3, 500, int(g.integers(1, 80))).tolist() for _ in range(others)]
    at = int(g.integers(0, others + 1))
    return extra[:at] + [prompts[target]] + extra[at:], at


@pytest.fixture(scope="module")
def alone(engine, prompts):
    """Each prompt alone, prefilled in one forward: the reference bits."""
    return [drive(engine, [p], chunk=0)[0] for p in prompts]


@pytest.mark.parametrize("chunk", [7, 64])
def test_chunked_prefill_equals_one_shot(engine, prompts, alone, chunk):
    for i, p in enumerate(prompts):
        assert_same(drive(engine, [p], chunk)[0], alone[i], f"prompt of {len(p)} in chunks of {chunk}")


@pytest.mark.parametrize("others", [1, 4, 16])
def test_a_session_among_others_equals_alone(engine, prompts, alone, others):
    for i in range(len(prompts)):
        mixed, at = with_company(prompts, i, others, seed=100 * others + i)
        got = drive(engine, mixed, chunk=(7, 64, 0)[i % 3])
        assert_same(got[at], alone[i], f"prompt of {len(prompts[i])} among {others} others")


def test_all_prompts_in_one_step_equal_each_alone(engine, prompts, alone):
    got = drive(engine, prompts, chunk=0)
    for i in range(len(prompts)):
        assert_same(got[i], alone[i], f"prompt {i} in a step holding every prompt")


def test_a_pipeline_reserves_its_projection_cpus_until_shutdown(ray_session, tiny_ckpt):
    """(From test_pipeline_infra.py, beside the module's pipeline: run before it holds any.) The
    projection actor's CPUs are the pipeline's placement group, on the actor's node; the actor
    asks for nothing itself (so a driver may keep it idle: pipeline/actor_pool.py)."""
    from engramflow.pipeline import placement

    free = ray.available_resources().get("CPU", 0.0)
    pipe = Pipeline.launch(tiny_ckpt, stages=1)
    (pg,) = [g for g in pipe.placement_groups if g is not None]
    table = ray.util.placement_group_table(pg)
    (bundle,) = table["bundles"].values()
    (where,) = pipe.where()["projections"]
    cores = placement.node_packages(where["node_id"])[0]
    assert table["state"] == "CREATED" and bundle == {"CPU": min(len(cores or [0]), free)}  # no engram_host asked
    assert ray.available_resources().get("CPU", 0.0) == free - bundle["CPU"]
    assert list(table["bundles_to_node_id"].values()) == [where["node_id"]]
    pipe.shutdown()
    assert ray.util.placement_group_table(pg)["state"] == "REMOVED"


@pytest.fixture(scope="module")
def pipe(ray_session):
    """The module's 2-stage pipeline (the default numerics)."""
    p = Pipeline.launch(V41_SMALL, stages=2)
    yield p
    p.shutdown()


def test_pipeline_reports_metrics(pipe):
    """(From test_pipeline_infra.py.) The first use of the module's pipeline: its metrics are
    this test's alone."""
    assert pipe.metrics.snapshot() == {}
    pipe.generate([[5, 6, 7, 8, 9]], max_new_tokens=4)
    snap = pipe.metrics.snapshot()
    assert snap["steps"] == 4  # one prefill chunk + three decode steps
    assert snap["step_ms"] > 0 and set(k for k in snap if k.startswith("wait_ms.")) == {"wait_ms.0", "wait_ms.1"}


def test_two_stage_pipeline_equals_engine(pipe, prompts, alone):
    assert pipe.numerics == "batched"
    mixed, at = with_company(prompts, 4, 4, seed=3)
    assert_same(drive(pipe, mixed, chunk=7)[at], alone[4], "2-stage pipeline, 4 others, chunks of 7")
    got = drive(pipe, prompts[:3], chunk=64)
    for i in range(3):
        assert_same(got[i], alone[i], f"2-stage pipeline, prompt {i} with 2 others")


def test_an_image_prompt_among_others_and_in_chunks(prompts):
    engine = Engine(V41_VISION)
    try:
        gold = vision_golden()
        name = next(iter(PROMPT_IMAGES))
        ids, images = gold[f"prompt.{name}"].tolist(), [IMAGES / n for n in PROMPT_IMAGES[name]]
        want = drive(engine, [ids], chunk=0, images=[images])[0]
        assert_same(drive(engine, [ids], chunk=7, images=[images])[0], want, "image prompt in chunks of 7")
        mixed = [prompts[0], ids, prompts[2], prompts[1]]
        got = drive(engine, mixed, chunk=64, images=[None, images, None, None])
        assert_same(got[1], want, "image prompt among 3 others, chunks of 64")
    finally:
        engine.shutdown()


def test_the_same_bits_at_any_thread_count(prompts):
    """Batched numerics split a product's columns, never its sums, across threads: one thread
    and the default give the same bits, an image prompt among others in chunks included (the
    suite runs its other modules at one thread on that ground, tests/conftest.py)."""
    default = torch.get_num_threads()
    if default < 2:
        pytest.skip("torch runs one thread here: nothing to compare")
    gold = vision_golden()
    name = next(iter(PROMPT_IMAGES))
    ids, images = gold[f"prompt.{name}"].tolist(), [IMAGES / n for n in PROMPT_IMAGES[name]]
    got = {}
    try:
        for threads in (default, 1):
            engine = Engine(V41_VISION, threads=threads)
            try:
                got[threads] = drive(engine, [prompts[1], ids], chunk=7, images=[None, images])
            finally:
                engine.shutdown()
    finally:
        torch.set_num_threads(default)
    for i in range(2):
        assert_same(got[1][i], got[default][i], f"session {i} at 1 and {default} threads")


def test_speculative_without_exact_equals_plain_greedy(engine, prompts):
    spec = Engine(V41_SMALL, speculative="dspark")
    try:
        texts = [p[:40] for p in prompts]
        plain = engine.generate(texts, max_new_tokens=12)
        drafted = spec.generate(texts, max_new_tokens=12)
        assert [g.tokens for g in drafted] == [g.tokens for g in plain]
    finally:
        spec.shutdown()


def test_official_numerics_run_per_session_forwards(prompts):
    """The named alternative: official numerics keep the official code's shapes (and bits:
    tests/test_v41_golden.py), so a prompt's chunking moves its logits there."""
    e = Engine(V41_SMALL, numerics="official")
    try:
        assert e.stage.numerics == "official"
        with pytest.raises(Exception, match="numerics"):
            Engine(V41_SMALL, numerics="fastest")
        one = drive(e, [prompts[3]], chunk=0)[0]
        seven = drive(e, [prompts[3]], chunk=7)[0]
        assert any(not torch.equal(a, b) for a, b in zip(one, seven))
    finally:
        e.shutdown()
    assert sum_order.current() == sum_order.default_numerics()  # nothing leaked out of a forward
