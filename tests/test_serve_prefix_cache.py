"""Prefix reuse through `engramflow serve`'s application (serve_server.ServeApp on the session's
Ray, v41-small) with the real `openai` client: a request answered from a cached prefix gives the
tokens and logprobs of the same request cold, bit for bit, on 1 stage decoding plainly and on 2
stages decoding speculatively (DSpark drafts), with an image; `usage.prompt_tokens_details.cached_tokens` says how much
of the prompt was not prefilled; a small budget keeps the stages' memory bounded over 200
conversations (measured RSS); /health shows the cache.

The budget (0.3 MiB) holds one ~130-token session of v41-small (about 1.9 KB a token on one
stage, a little more on two) but not two: so a prompt's cold answer is taken first, then a
shorter prefix of it evicts that session, and the prompt is asked again to hit the shorter one
and prefill the rest in other chunks than cold."""
import base64
import threading
from pathlib import Path

import numpy as np
import openai
import pytest

from serve_server import ServeApp
from test_serve import call
from v41_vision_golden import IMAGES

MODEL = "v41-small"
BUDGET_MB = "0.3"


def _app(serve_http, ckpt, tmp_path_factory, name, stages=1, extra=()):
    return ServeApp(serve_http, ckpt, tmp_path_factory.mktemp(name), name, stages=stages, backbone="v41", model=MODEL,
                    extra=("--prefix-cache-mb", BUDGET_MB, *extra))


@pytest.fixture(scope="module", params=[1, 2], ids=["1-stage", "2-stages"])
def app(request, serve_http, v41_small_preset, tmp_path_factory):
    """1 stage, plain decoding; 2 stages with speculative decoding (DSpark drafts on the last
    stage): every prefix test runs on both, the decoding kind apart."""
    others = set(_stage_pids())  # other apps' stages (the session's server, conftest's v41 app) stay up
    extra = ("--speculative", "dspark") if request.param == 2 else ()
    server = _app(serve_http, v41_small_preset, tmp_path_factory, f"prefix{request.param}", stages=request.param,
                  extra=extra)
    server.stage_pids = lambda: [pid for pid in _stage_pids() if pid not in others]
    yield server
    server.stop()


def client_of(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=server.key, max_retries=0, timeout=300)


def complete(client, ids, n=8):
    """(token ids, logprobs, top logprobs, cached tokens) of a sampled completion."""
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=n, temperature=0.8, seed=7, logprobs=3,
                                  extra_body={"return_tokens_as_token_ids": True})
    lp = r.choices[0].logprobs
    return lp.tokens, lp.token_logprobs, lp.top_logprobs, r.usage.prompt_tokens_details.cached_tokens


def cache_stats(server) -> dict:
    return call(server, "GET", "/health", key=False)[2]["prefix_cache"]


def test_a_hit_equals_the_same_request_cold(app):
    client = client_of(app)
    rng = np.random.default_rng(1)
    full = rng.integers(300, 60000, 120).tolist()  # one cold prompt, its prefix, then it again
    *cold, cached = complete(client, full)
    assert cached == 0
    short = full[:70]
    assert complete(client, short)[3] == 69  # it shares 70 with the cached one; its last token is prefilled
    before = cache_stats(app)
    *hit, cached = complete(client, full)
    assert hit == cold  # tokens, logprobs and top logprobs, bit for bit
    assert 70 <= cached < 120  # the short session (70 + its tokens): the full one was evicted for the budget
    after = cache_stats(app)
    assert after["hits"] == before["hits"] + 1 and after["cached_tokens"] == before["cached_tokens"] + cached
    assert after["evictions"] >= 1 and 0 < after["bytes"] <= after["budget_bytes"]
    assert after["token_bytes"] == sum(after["stage_token_bytes"]) + 16


def test_a_second_chat_turn_shares_the_first(app):
    """Thinking off: turn 2 repeats turn 1's prompt and answer, then adds a message: all of turn
    1's session but its last token (never written) is shared."""
    client = client_of(app)
    kw = dict(model=MODEL, max_tokens=6, temperature=0, extra_body={"chat_template_kwargs": {"thinking": False}})
    turn1 = [{"role": "system", "content": "You are terse. " * 20}, {"role": "user", "content": "Hello there."}]
    r1 = client.chat.completions.create(messages=turn1, **kw)
    turn2 = turn1 + [{"role": "assistant", "content": r1.choices[0].message.content or "Hi."},
                     {"role": "user", "content": "And again?"}]
    r2 = client.chat.completions.create(messages=turn2, **kw)
    assert r2.usage.prompt_tokens_details.cached_tokens >= r1.usage.prompt_tokens
    stream = client.chat.completions.create(messages=turn2, stream=True, stream_options={"include_usage": True}, **kw)
    usage = [c.usage for c in stream if c.usage is not None][-1]
    assert usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens - 1  # the same prompt: all but its last


@pytest.fixture(scope="module")
def engine(v41_small_preset):
    from engramflow.pipeline.engine import Engine

    e = Engine(v41_small_preset)
    yield e
    e.shutdown()


def test_concurrent_requests_fork_one_cached_prefix(app, engine):
    """Four requests sent at once, each extending one cached prompt: each forks the cached session
    (cached_tokens covers the shared part) and its greedy tokens are those of the in-process
    Engine's cold run of the same prompt."""
    client = client_of(app)
    rng = np.random.default_rng(11)
    base = rng.integers(300, 60000, 60).tolist()
    client.completions.create(model=MODEL, prompt=base + [400], max_tokens=1, temperature=0)  # cached now
    prompts = [base + rng.integers(300, 60000, 30).tolist() for _ in range(4)]
    got = [None] * 4

    def ask(i):
        r = client.completions.create(model=MODEL, prompt=prompts[i], max_tokens=6, temperature=0, logprobs=1,
                                      extra_body={"return_tokens_as_token_ids": True})
        got[i] = ([int(t.split(":")[1]) for t in r.choices[0].logprobs.tokens],
                  r.usage.prompt_tokens_details.cached_tokens)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    cold = [g.tokens for g in engine.generate(prompts, max_new_tokens=6)]
    assert [tokens for tokens, _ in got] == cold
    assert all(cached >= 60 for _, cached in got), got


def _image_messages(name: str) -> list:
    url = "data:image/png;base64," + base64.b64encode((IMAGES / name).read_bytes()).decode()
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": "What is in this picture? Say it in one word."}]}]


def test_an_image_hits_only_with_the_same_pixels(app):
    client = client_of(app)
    kw = dict(model=MODEL, max_tokens=6, temperature=0.8, seed=3, logprobs=True, top_logprobs=2,
              extra_body={"chat_template_kwargs": {"thinking": False}, "return_tokens_as_token_ids": True})
    cold = client.chat.completions.create(messages=_image_messages("rgb_small.png"), **kw)
    hit = client.chat.completions.create(messages=_image_messages("rgb_small.png"), **kw)
    assert hit.usage.prompt_tokens_details.cached_tokens == hit.usage.prompt_tokens - 1  # the image's span included
    assert hit.choices[0].logprobs.model_dump() == cold.choices[0].logprobs.model_dump()
    other = client.chat.completions.create(messages=_image_messages("rgba.png"), **kw)
    assert other.usage.prompt_tokens_details.cached_tokens < 8  # the text before the image, never its span


def _stage_pids() -> list[int]:
    """The stage actors of this test session's Ray: the raylet's children titled
    ray::BackboneStageActor (an app's own: `app.stage_pids()`)."""
    import ray

    raylet = ray._private.worker._global_node.all_processes["raylet"][0].process.pid
    pids = []
    for d in Path("/proc").iterdir():
        try:
            if not d.name.isdigit() or int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) != raylet:
                continue
            if (d / "cmdline").read_bytes().startswith(b"ray::BackboneStageActor"):
                pids.append(int(d.name))
        except (OSError, IndexError, ValueError):
            continue
    return sorted(pids)


def _stage_rss_kb(app) -> int:
    """Resident memory of the app's stage actors, summed (the cached sessions' K/V lives there)."""
    total = 0
    for pid in app.stage_pids():
        try:
            total += next(int(line.split()[1]) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                          if line.startswith("VmRSS:"))
        except (OSError, StopIteration):
            continue
    assert total, "no stage actor found"
    return total


@pytest.mark.slow
def test_eviction_keeps_memory_bounded_over_200_conversations(app):
    """200 conversations, 8 at a time, each a shared 120-token instruction and 8 tokens of its
    own: kept without eviction, their sessions (a hit forks an independent copy of the cached
    prefix) would hold 200 x 129 x ~1.9 KB = ~49 MB on the stage (up to twice that with the
    buffers' doubling); the budget keeps one, and each conversation still finds the instruction
    in whichever one is kept. The instruction is long and each conversation's own part short:
    the memory at stake is the same as with a short instruction and long own parts, for a tenth
    of the prefill."""
    if app.name != "prefix1":
        pytest.skip("measured once, on one stage")
    client = client_of(app)
    instruction = np.random.default_rng(5).integers(300, 60000, 120).tolist()

    def conversation(seed):
        own = np.random.default_rng(seed).integers(300, 60000, 8).tolist()
        client.completions.create(model=MODEL, prompt=instruction + own, max_tokens=2, temperature=0)

    def run(seeds):
        threads = [threading.Thread(target=lambda s=s: [conversation(int(x)) for x in s])
                   for s in np.array_split(seeds, 8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    seeds = np.random.default_rng(2).integers(0, 2**31, 200)
    start = cache_stats(app)
    run(seeds[:20])
    warm = _stage_rss_kb(app)
    run(seeds[20:])
    grown_mb = (_stage_rss_kb(app) - warm) / 1024
    stats = cache_stats(app)
    print(f"stage RSS grew {grown_mb:.1f} MB over 180 conversations; cache {stats}")
    assert stats["bytes"] <= stats["budget_bytes"] and stats["evictions"] - start["evictions"] >= 150
    assert stats["hits"] - start["hits"] >= 150  # the instruction, from whichever session is kept
    assert grown_mb < 25, f"the stage grew {grown_mb:.1f} MB with a {BUDGET_MB} MiB cache"
    health = call(app, "GET", "/health", key=False)[2]
    assert health["sessions"] == 0 and health["prefix_cache"]["entries"] >= 1


def test_speculative_hit_equals_cold(app):
    """Twelve sampled tokens (several verify blocks) from a hit equal the cold answer; the
    2-stage app drafted them."""
    client = client_of(app)
    full = np.random.default_rng(4).integers(300, 60000, 120).tolist()
    *cold, cached = complete(client, full, n=12)
    assert cached == 0
    assert complete(client, full[:70])[3] == 69
    *hit, cached = complete(client, full, n=12)
    assert cached >= 70 and hit == cold
    drafted = call(app, "GET", "/health", key=False)[2].get("speculative", {}).get("drafted", 0)
    assert (drafted > 0) == (app.name == "prefix2")


def test_a_killed_stage_rebuilds_the_cached_sessions_by_replay(app):
    """The cached sessions are open sessions in the runner's log: when the stage holding them is
    killed, the pipeline's recovery replays them with the rest, and a hit after it is still
    bit-identical to the cold answer taken before the kill."""
    import os
    import signal

    if app.name != "prefix1":
        pytest.skip("once, on one stage")
    client = client_of(app)
    full = np.random.default_rng(6).integers(300, 60000, 100).tolist()
    *cold, _ = complete(client, full)
    (pid,) = app.stage_pids()
    os.kill(pid, signal.SIGKILL)
    *hit, cached = complete(client, full)
    assert cached == 99 and hit == cold
    assert app.stage_pids() != [pid]  # a new stage process answered
