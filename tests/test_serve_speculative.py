"""`engramflow serve --speculative dspark:exact`: the server's application on the session's Ray
(serve_server.ServeApp: 2 pipeline stages, the small official model with its DSpark draft layers) spoken to with the real `openai` client. Its
greedy tokens equal plain greedy decoding (the in-process Engine without drafts), alone and as
concurrent streams; a stop string cuts exactly; /health reports the drafting. (This model's
512-token vocabulary has no chat tokens; tests/test_serve_speculative_scheduler.py runs a chat
request in process on the v41-small preset.)"""
import asyncio

import openai
import pytest

from engramflow.pipeline.engine import Engine
from serve_server import PREFILL_CHUNK, ServeApp
from speculative_cases import long_ckpt  # noqa: F401 (fixture)
from test_serve import solo, token_ids_of, wait_idle

MODEL = "v41-small"


@pytest.fixture(scope="module")
def server(serve_http, long_ckpt, tmp_path_factory):
    s = ServeApp(serve_http, long_ckpt, tmp_path_factory.mktemp("serve-spec"), "spec", backbone=None, model=MODEL,
                 extra=("--speculative", "dspark:exact"))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def engine(long_ckpt):
    e = Engine(long_ckpt, prefill_chunk=PREFILL_CHUNK)  # plain decoding: the oracle
    yield e
    e.shutdown()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=server.key, max_retries=0, timeout=300)


@pytest.mark.parametrize("stream", [False, True])
def test_greedy_completion_equals_plain_decoding(client, engine, stream):
    ids = list(range(100, 137))  # 3 prefill chunks
    want = solo(engine, ids, 20, None)
    kw = dict(model=MODEL, prompt=ids, max_tokens=20, temperature=0, logprobs=1,
              extra_body={"return_tokens_as_token_ids": True})
    if stream:
        chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
        got = token_ids_of([t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens])
        assert chunks[-1].usage.completion_tokens == len(want)
    else:
        r = client.completions.create(**kw)
        got = token_ids_of(r.choices[0].logprobs.tokens)
        assert r.usage.completion_tokens == len(want)
    assert got == want


def test_stop_string_cuts_exactly(client):
    kw = dict(model=MODEL, prompt=list(range(300, 320)), max_tokens=16, temperature=0)
    full = client.completions.create(**kw).choices[0].text
    stop = full[len(full) // 2:len(full) // 2 + 2]
    r = client.completions.create(stop=[stop], **kw)
    assert r.choices[0].text == full[:full.index(stop)] and r.choices[0].finish_reason == "stop"


def test_concurrent_streams_each_equal_their_solo_run(server, engine):
    prompts = [list(range(10 + 7 * k, 30 + 9 * k)) for k in range(6)]
    wants = [solo(engine, p, 10, None) for p in prompts]

    async def one(client, p):
        chunks = await client.completions.create(model=MODEL, prompt=p, max_tokens=10, temperature=0, logprobs=0,
                                                 stream=True, extra_body={"return_tokens_as_token_ids": True})
        return token_ids_of([t async for c in chunks if c.choices and c.choices[0].logprobs
                             for t in c.choices[0].logprobs.tokens])

    async def run():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=server.key, max_retries=0,
                                      timeout=300) as client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    assert asyncio.run(run()) == wants
    health = wait_idle(server)
    spec = health["speculative"]
    assert spec["drafted"] > 0 and spec["emitted"] > spec["steps"] * 0.99  # every verified step emits a token
