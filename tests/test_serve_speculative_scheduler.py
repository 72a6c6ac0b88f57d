"""Speculative decoding in the serving scheduler, in process (the small official model, no Ray):
verify blocks share steps with prefill chunks and other requests' decodes, the tokens equal plain
greedy decoding, a block's tokens reach the sink one by one (a stop inside a block cuts exactly
there, the rest is dropped), drafts never pass max_tokens or the model's length, the API's stop
strings cut inside an accepted block, and a greedy chat request equals plain decoding."""
import threading

import time

import pytest

from engramflow.model.sampling import Sampling
from engramflow.pipeline.engine import Engine
from engramflow.serve.picking import pick_factory
from engramflow.scheduling import Request, Scheduler
from speculative_cases import PROMPT, KnownDrafts, long_ckpt  # noqa: F401 (fixture)

PROMPTS = [PROMPT, [9, 8, 7, 6, 5, 4, 3, 2, 1, 11, 12, 13], list(range(40, 75))]
N = 24


class Collect:
    """A sink that keeps its tokens and ends the request after `limit` of them, or at `stop_at`."""

    def __init__(self, limit: int, stop_at: int | None = None):
        self.limit, self.stop_at, self.tokens, self.reason = limit, stop_at, [], None
        self.done = threading.Event()

    def on_token(self, picked):
        self.tokens.append(picked.token)
        if len(self.tokens) - 1 == self.stop_at:
            return "stop"
        return "length" if len(self.tokens) >= self.limit else None

    def on_finish(self, reason):
        self.reason = reason
        self.done.set()

    def on_error(self, message):
        raise AssertionError(message)


@pytest.fixture(scope="module")
def plain(long_ckpt):
    e = Engine(long_ckpt, prefill_chunk=16)
    tokens = [e.generate([p], max_new_tokens=N)[0].tokens for p in PROMPTS]
    e.shutdown()
    return tokens


def _drain(sched, jobs):
    while any(not j.sink.done.is_set() for j in jobs):
        sched.step()


def _known(long_ckpt, plain, spec="dspark:exact", **kw):
    e = KnownDrafts(long_ckpt, prefill_chunk=16, speculative=spec, **kw)
    for p, t in zip(PROMPTS, plain):
        e.plant(p, t)
    return e


@pytest.mark.parametrize("spec", ["dspark:exact", "dspark:exact:adaptive"])
def test_concurrent_requests_with_accepts_and_rejects_equal_plain_greedy(long_ckpt, plain, spec):
    e = _known(long_ckpt, plain, spec, spoil=lambda j, i: (3 * j + i) % 4 == 0)
    sched = Scheduler(e, depth=2)
    jobs = [sched.add(Request(list(p), pick_factory(Sampling()), Collect(N), max_tokens=N)) for p in PROMPTS]
    _drain(sched, jobs)
    stats = sched.speculative_stats
    assert [j.sink.tokens for j in jobs] == plain
    assert 0 < stats.accepted < stats.drafted and stats.emitted == 3 * (N - 1)
    assert (stats.gated > 0) == spec.endswith("adaptive")  # the gate kept some steps from drafting
    assert e.sessions == []
    e.shutdown()


def test_real_draft_layers_equal_plain_greedy(long_ckpt, plain):
    e = Engine(long_ckpt, prefill_chunk=16, speculative="dspark:exact")
    sched = Scheduler(e)
    jobs = [sched.add(Request(list(p), pick_factory(Sampling()), Collect(12), max_tokens=12)) for p in PROMPTS[:2]]
    _drain(sched, jobs)
    assert [j.sink.tokens for j in jobs] == [t[:12] for t in plain[:2]]
    assert sched.speculative_stats.drafted > 0
    e.shutdown()


@pytest.mark.parametrize("stop_at", [7, 8])
def test_a_stop_inside_an_accepted_block_ends_the_request_there(long_ckpt, plain, stop_at):
    """Every draft right, 2 per block: tokens 1-3, 4-6, 7-9 come in blocks; 7 and 8 are the
    block's first and second tokens, the rest of the block is dropped."""
    e = _known(long_ckpt, plain)
    sched = Scheduler(e)
    job = sched.add(Request(list(PROMPT), pick_factory(Sampling()), Collect(N, stop_at=stop_at), max_tokens=N))
    _drain(sched, [job])
    assert job.sink.tokens == plain[0][:stop_at + 1] and job.sink.reason == "stop"
    assert sched.speculative_stats.accepted == sched.speculative_stats.drafted == 6  # the blocks were whole
    assert e.sessions == []
    e.shutdown()


def test_drafts_stop_short_of_max_tokens(long_ckpt, plain):
    e = _known(long_ckpt, plain)
    sched = Scheduler(e)
    job = sched.add(Request(list(PROMPT), pick_factory(Sampling()), Collect(6), max_tokens=6))
    _drain(sched, [job])
    stats = sched.speculative_stats
    assert job.sink.tokens == plain[0][:6]
    assert stats.emitted == 5 and stats.drafted == 3  # tokens 1-3 in one block, then 4-5: one draft only
    e.shutdown()


def test_sampled_requests_draw_what_generate_speculative_draws(long_ckpt):
    sampling = Sampling(temperature=0.9, top_k=40, seed=5)
    e = Engine(long_ckpt, prefill_chunk=16, speculative="dspark")
    want = [e.generate([p], max_new_tokens=10, sampling=sampling)[0].tokens for p in PROMPTS[:2]]
    sched = Scheduler(e)
    jobs = [sched.add(Request(list(p), pick_factory(sampling), Collect(10), max_tokens=10)) for p in PROMPTS[:2]]
    _drain(sched, jobs)
    assert [j.sink.tokens for j in jobs] == want
    e.shutdown()


def test_api_stop_string_inside_an_accepted_block_cuts_exactly(long_ckpt, plain):
    """Through the API (in process: real Output, stop strings, detokenizer) with every draft
    right: a stop string made of a block's middle token ends the text before it, and the
    request consumed exactly the tokens up to that one."""
    from fastapi.testclient import TestClient

    from engramflow.serve.api import make_api
    from engramflow.serve.backend import Backend, ServeConfig

    e = _known(long_ckpt, plain)
    backend = Backend(e, ServeConfig.build(str(long_ckpt), model="m", in_process=True, prefill_chunk=16))
    client = TestClient(make_api(lambda: backend))

    def complete(max_tokens, **kw):
        r = client.post("/v1/completions", json={"model": "m", "prompt": PROMPT, "max_tokens": max_tokens,
                                                 "temperature": 0, **kw})
        assert r.status_code == 200, r.text
        return r.json()

    try:
        for i in (2, 5, 8, 11, 14, 17, 20):  # a block's middle token: blocks are tokens 1-3, 4-6, ...
            head, upto = complete(i)["choices"][0]["text"], complete(i + 1)["choices"][0]["text"]
            stop = upto[len(head):]
            if stop and upto.startswith(head) and upto.find(stop) == len(head):
                break
        else:
            pytest.fail("no token with its own text to stop at")
        drafted = backend.scheduler.speculative_stats.drafted
        r = complete(N, stop=[stop])
        assert r["choices"][0]["text"] == head and r["choices"][0]["finish_reason"] == "stop"
        assert r["usage"]["completion_tokens"] == i + 1
        stats = backend.scheduler.speculative_stats
        assert stats.drafted - drafted == 2 * ((i + 2) // 3) and stats.accepted == stats.drafted  # whole blocks
        # the stop string ends the response first; the scheduler's thread then closes the session
        deadline = time.monotonic() + 10
        while backend.health()["sessions"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert backend.health()["sessions"] == 0
    finally:
        backend.close()


def test_metrics_count_drafted_and_accepted_tokens(long_ckpt, plain, ray_session):  # noqa: F811
    """The scheduler reports each verified block's drafted and accepted counts to ServeMetrics
    (Ray's metrics API): their sums are the scheduler's own stats."""
    from engramflow.serve.metrics import ServeMetrics

    class Seen(ServeMetrics):
        def __init__(self):
            super().__init__()
            self.counts = []

        def speculative(self, drafted, accepted):
            super().speculative(drafted, accepted)
            self.counts.append((drafted, accepted))

    e = _known(long_ckpt, plain, spoil=lambda j, i: (3 * j + i) % 4 == 0)
    metrics = Seen()
    sched = Scheduler(e, metrics=metrics)
    job = sched.add(Request(list(PROMPT), pick_factory(Sampling()), Collect(N), max_tokens=N))
    _drain(sched, [job])
    stats = sched.speculative_stats
    assert len(metrics.counts) == stats.steps
    assert [sum(c) for c in zip(*metrics.counts)] == [stats.drafted, stats.accepted] and 0 < stats.accepted
    assert sched.stats()["speculative"]["drafted"] == stats.drafted
    e.shutdown()


def test_drafts_stop_short_of_the_model_length(long_ckpt, plain):
    """A request without max_tokens runs to the model's length: the last blocks shrink so that
    every block fits, and the sink sees generate's tokens."""
    e = _known(long_ckpt, plain, spoil=lambda j, i: True)  # every draft wrong: one token per step
    prompt = list(range(1, 300))
    e.plant(prompt, [])
    want = e.generate([prompt], max_new_tokens=320 - len(prompt))[0].tokens
    sched = Scheduler(e)
    job = sched.add(Request(prompt, pick_factory(Sampling()), Collect(1000)))
    while not e.sessions or len(job.sink.tokens) < len(want):
        sched.step()
    assert job.sink.tokens == want
    job.cancel()
    _drain(sched, [job])
    assert e.sessions == []
    e.shutdown()


def test_api_greedy_chat_equals_plain_decoding(v41_small_preset):
    """A chat request (the v41-small preset: the real tokenizer's vocabulary) on a speculative
    server backend: its tokens are plain greedy decoding's of the encoder's prompt."""
    from fastapi.testclient import TestClient

    from engramflow.chat import ChatOptions, encode_chat
    from engramflow.serve.api import make_api
    from engramflow.serve.backend import Backend, ServeConfig

    cfg = ServeConfig.build(str(v41_small_preset), model="m", in_process=True, prefill_chunk=32, speculative="dspark:exact")
    backend = Backend(Engine(cfg.engine), cfg)
    oracle = Engine(v41_small_preset, prefill_chunk=32)
    try:
        messages = [{"role": "user", "content": "Name three colours."}]
        ids = backend.encode(encode_chat(messages, ChatOptions(thinking=False)))
        want = oracle.generate([ids], max_new_tokens=10)[0].tokens
        eos = backend.tokenizer.token_to_id("<｜end▁of▁sentence｜>")
        want = want[:want.index(eos)] if eos in want else want
        r = TestClient(make_api(lambda: backend)).post("/v1/chat/completions", json={
            "model": "m", "messages": messages, "max_tokens": 10, "temperature": 0, "logprobs": True,
            "chat_template_kwargs": {"thinking": False}, "return_tokens_as_token_ids": True})
        assert r.status_code == 200, r.text
        assert [int(e["token"].split(":")[1]) for e in r.json()["choices"][0]["logprobs"]["content"]] == want
        assert backend.scheduler.speculative_stats.drafted > 0
    finally:
        backend.close()
        oracle.shutdown()


def test_verify_blocks_share_steps_with_prefill_chunks_and_plain_decodes(long_ckpt, plain):
    """A top_p request decodes plainly (no drafts) next to drafting requests, in the same steps,
    with the tokens it gets on a plain server; a long prompt's chunks join those steps too."""
    top_p = pick_factory(Sampling(temperature=0.9, seed=3), top_p=0.8)
    oracle = Engine(long_ckpt, prefill_chunk=16)
    solo = Scheduler(oracle)
    alone = solo.add(Request(list(PROMPTS[1]), top_p, Collect(12), max_tokens=12))
    _drain(solo, [alone])
    oracle.shutdown()

    e = _known(long_ckpt, plain)
    kinds = []  # what each step held: "verify", "decode" or "prefill"
    submit = e.submit

    def seen(requests):
        kinds.append({"verify" if getattr(r.pick, "verifies", False) else "prefill" if r.ids.size > 1
                      else "decode" for r in requests})
        return submit(requests)

    e.submit = seen
    sched = Scheduler(e, max_sessions=4)
    drafting = sched.add(Request(list(PROMPT), pick_factory(Sampling()), Collect(N), max_tokens=N))
    plain_job = sched.add(Request(list(PROMPTS[1]), top_p, Collect(12), max_tokens=12))
    while len(drafting.sink.tokens) < 3:
        sched.step()
    long = sched.add(Request(list(range(100, 180)), pick_factory(Sampling()), Collect(2), max_tokens=2))
    _drain(sched, [drafting, plain_job, long])
    assert plain_job.sink.tokens == alone.sink.tokens and drafting.sink.tokens == plain[0]
    assert {"verify", "decode"} in [k & {"verify", "decode"} for k in kinds]
    assert any({"verify", "prefill"} <= k for k in kinds)
    assert plain_job.speculation is None and drafting.speculation is not None
    e.shutdown()
