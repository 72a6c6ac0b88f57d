"""The OpenAI-compatible server, as a real `engramflow serve` process (2 pipeline stages on Ray
Serve, tiny checkpoint) spoken to with the real `openai` client and plain HTTP. Tokens are
compared with the in-process Engine's `generate` for the same prompt and seed."""
import asyncio
import http.client
import json
import os
import signal
import time
from urllib.parse import urlparse

import openai
import pytest

from engramflow.chat import ChatOptions, encode_chat, parse_completion
from engramflow.io.tokenizer_file import load_checkpoint_tokenizer
from engramflow.model.sampling import Sampling
from engramflow.pipeline.engine import Engine
from engramflow.serve.picking import BiasedPick
from serve_server import BACKBONE, MAX_QUEUE, MAX_SESSIONS, PREFILL_CHUNK

EOS = 1


@pytest.fixture(scope="module")
def engine(tiny_ckpt):
    e = Engine(tiny_ckpt, backbone=BACKBONE, prefill_chunk=PREFILL_CHUNK)
    yield e
    e.shutdown()


@pytest.fixture(scope="module")
def tok(tiny_ckpt):
    return load_checkpoint_tokenizer(tiny_ckpt)


@pytest.fixture(scope="module")
def client(serve_server):
    return openai.OpenAI(base_url=serve_server.url + "/v1", api_key=serve_server.key, max_retries=0, timeout=120)


def solo(engine, ids, n, sampling):
    """The Engine's tokens for one prompt, ending where the server ends: at EOS."""
    tokens = engine.generate([ids], max_new_tokens=n, sampling=sampling)[0].tokens
    return tokens[:tokens.index(EOS)] if EOS in tokens else tokens


def token_ids(entries) -> list[int]:
    return [int(e.token.split(":")[1]) for e in entries]


def call(server, method, path, body=None, key=True, raw=None):
    u = urlparse(server.url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {server.key}"} if key else {})
    conn.request(method, u.path.rstrip("/") + path, raw if raw is not None else (json.dumps(body) if body is not None else None), headers)
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    return resp.status, dict(resp.getheaders()), json.loads(data) if data else None


def wait_idle(server, timeout=60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        _, _, health = call(server, "GET", "/health", key=False)
        if health["running"] == 0 and health["waiting"] == 0 and health["sessions"] == 0:
            return health
        time.sleep(0.2)
    raise AssertionError(f"the server kept sessions: {health}")


def test_models_and_health(serve_server, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    status, _, body = call(serve_server, "GET", "/health", key=False)
    assert status == 200 and body["status"] == "ok"


@pytest.mark.parametrize("stream", [False, True])
def test_completion_tokens_equal_engine_generate(client, engine, stream):
    ids = list(range(100, 137))  # 37 tokens: 3 prefill chunks
    want = solo(engine, ids, 12, Sampling(temperature=0.9, top_k=40, seed=5))
    kw = dict(model="tiny", prompt=ids, max_tokens=12, temperature=0.9, seed=5, logprobs=1,
              extra_body={"top_k": 40, "return_tokens_as_token_ids": True})
    if not stream:
        r = client.completions.create(**kw)
        got, text, reason = token_ids_of(r.choices[0].logprobs.tokens), r.choices[0].text, r.choices[0].finish_reason
        assert r.usage.completion_tokens == len(want) and r.usage.prompt_tokens == len(ids)
    else:
        chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
        got = token_ids_of([t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens])
        reason = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want)
    assert got == want
    assert reason == ("length" if len(want) == 12 else "stop")


def token_ids_of(pieces) -> list[int]:
    return [int(p.split(":")[1]) for p in pieces]


@pytest.mark.parametrize("stream", [False, True])
def test_chat_tokens_equal_engine_generate(client, engine, tok, stream):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name three colours."}]
    ids = tok.encode(encode_chat(messages, ChatOptions(thinking=False)), add_special_tokens=False).ids
    want = solo(engine, ids, 10, Sampling(temperature=0.7, seed=9))
    kw = dict(model="tiny", messages=messages, max_tokens=10, temperature=0.7, seed=9, logprobs=True,
              extra_body={"chat_template_kwargs": {"thinking": False}, "return_tokens_as_token_ids": True})
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **kw))
        got = token_ids([e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content])
    else:
        r = client.chat.completions.create(**kw)
        got = token_ids(r.choices[0].logprobs.content)
    assert got == want


def test_completion_prompt_text_reads_special_tokens_as_single_ids(client, engine, tok):
    """A prompt the chat encoder wrote, sent as text to /v1/completions: the same tokens."""
    text = encode_chat([{"role": "user", "content": "Hello"}], ChatOptions(thinking=True))
    ids = tok.encode(text, add_special_tokens=False).ids
    assert len(ids) < len(text) // 3  # the special tokens are single ids, not spelled out
    want = solo(engine, ids, 6, Sampling(temperature=0.5, seed=2))
    r = client.completions.create(model="tiny", prompt=text, max_tokens=6, temperature=0.5, seed=2, logprobs=0,
                                  extra_body={"return_tokens_as_token_ids": True})
    assert token_ids_of(r.choices[0].logprobs.tokens) == want and r.usage.prompt_tokens == len(ids)


def test_stop_string_is_cut_exactly_across_tokens(client, tok):
    kw = dict(model="tiny", prompt=list(range(300, 320)), max_tokens=16, temperature=0)
    r = client.completions.create(logprobs=0, extra_body={"return_tokens_as_token_ids": True}, **kw)
    full, ids = r.choices[0].text, token_ids_of(r.choices[0].logprobs.tokens)
    # a boundary between two generated tokens, with text on both sides: the stop string spans it
    b = next(len(head) for k in range(2, len(ids)) if full.startswith(head := tok.decode(ids[:k]))
             and 2 <= len(head) <= len(full) - 2)
    stop = full[b - 2:b + 2]
    r = client.completions.create(stop=[stop, "never-seen-stop"], **kw)
    assert r.choices[0].text == full[:full.index(stop)] and r.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(stop=stop, stream=True, **kw) if c.choices)
    assert streamed == full[:full.index(stop)]


def test_max_tokens(client):
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "go"}],
                                       max_completion_tokens=3, temperature=0, logit_bias={"11932": 100})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3
    assert r.choices[0].message.reasoning_content == "OKOKOK"  # thinking is on by default


def _forced(engine, ids, allowed, n):
    """What greedy decoding with +100 on `allowed` writes: the Engine with the server's pick."""
    s = engine.open()
    try:
        pick = lambda k: BiasedPick(Sampling(), 0, k, 0, 1.0, tuple((t, 100.0) for t in sorted(allowed)))
        out = [engine.prefill(s, ids, pick=pick(0)).token]
        while len(out) < n and out[-1] != EOS:
            logits = engine.decode_step({s: out[-1]})[s]
            out.append(pick(len(out))(logits).token)
    finally:
        engine.close(s)
    return out[:out.index(EOS)] if EOS in out else out


@pytest.mark.parametrize("stream", [False, True])
def test_logit_bias_forced_reasoning_and_content_parse_end_to_end(client, engine, tok, stream):
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    ids = tok.encode(encode_chat(messages, ChatOptions(thinking=True)), add_special_tokens=False).ids
    allowed = {128822, 53624, 11111, 271}  # "</think>", "Sure", " Paris", "\n\n"
    want_ids = _forced(engine, ids, allowed, 12)
    assert set(want_ids) <= allowed
    want = parse_completion(tok.decode(want_ids, skip_special_tokens=False), thinking=True)
    kw = dict(model="tiny", messages=messages, max_tokens=12, temperature=0,
              logit_bias={str(t): 100 for t in allowed})
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **kw))
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
        also = "".join(getattr(d, "reasoning", None) or "" for d in deltas)
        content = "".join(d.content or "" for d in deltas)
    else:
        msg = client.chat.completions.create(**kw).choices[0].message
        reasoning, also, content = msg.reasoning_content, msg.reasoning, msg.content
    assert (reasoning, content) == (want["reasoning_content"], want["content"]) and also == reasoning


def test_32_concurrent_streams_each_equal_its_solo_run(serve_server, engine):
    prompts = [list(range(200 + k, 210 + 2 * k)) for k in range(32)]
    wants = [solo(engine, p, 6, Sampling(temperature=1.0, seed=k)) for k, p in enumerate(prompts)]

    async def one(c, k):
        stream = await c.completions.create(model="tiny", prompt=prompts[k], max_tokens=6, temperature=1.0, seed=k,
                                            stream=True, logprobs=0, extra_body={"return_tokens_as_token_ids": True})
        return token_ids_of([t async for ch in stream if ch.choices and ch.choices[0].logprobs
                             for t in ch.choices[0].logprobs.tokens])

    async def run():
        async with openai.AsyncOpenAI(base_url=serve_server.url + "/v1", api_key=serve_server.key,
                                      max_retries=0, timeout=300) as c:
            return await asyncio.gather(*(one(c, k) for k in range(32)))

    assert asyncio.run(run()) == wants
    wait_idle(serve_server)


def _open_stream(server, body):
    u = urlparse(server.url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps(body),
                 {"Content-Type": "application/json", "Authorization": f"Bearer {server.key}"})
    return conn, conn.getresponse()


def test_disconnect_mid_stream_frees_the_session(serve_server):
    wait_idle(serve_server)
    conn, resp = _open_stream(serve_server, {"prompt": [5, 6, 7], "max_tokens": 3000, "stream": True,
                                             "temperature": 0, "logit_bias": {"11932": 100}})
    assert resp.status == 200
    resp.fp.readline()  # the first event arrived: the session is decoding
    assert call(serve_server, "GET", "/health", key=False)[2]["sessions"] == 1
    conn.sock.close()
    conn.close()
    wait_idle(serve_server)


def test_429_with_retry_after_under_overload(serve_server):
    wait_idle(serve_server)
    body = {"prompt": [5, 6, 7], "max_tokens": 3000, "stream": True, "temperature": 0, "logit_bias": {"11932": 100}}
    opened, refused = [], []
    for _ in range(MAX_SESSIONS + MAX_QUEUE + 3):
        conn, resp = _open_stream(serve_server, body)
        if resp.status == 429:
            refused.append((dict(resp.getheaders()), json.loads(resp.read())))
            conn.close()
        else:
            opened.append(conn)
    assert len(opened) == MAX_SESSIONS + MAX_QUEUE and len(refused) == 3
    headers, err = refused[0]
    assert headers["retry-after"] == "1" and err["error"]["type"] == "rate_limit_error"
    assert set(err["error"]) == {"message", "type", "param", "code"}
    for conn in opened:
        conn.sock.close()
        conn.close()
    wait_idle(serve_server)


@pytest.mark.parametrize("path, raw, param", [
    ("/v1/completions", "{not json", None),
    ("/v1/completions", json.dumps({"prompt": "hi", "temperature": "hot"}), "temperature"),
    ("/v1/chat/completions", json.dumps({"messages": [{"role": "wizard", "content": "x"}]}), "messages[0].role"),
    ("/v1/completions", json.dumps({"prompt": list(range(10, 4200))}), "prompt"),
    ("/v1/completions", json.dumps({"prompt": "hi", "n": 17}), "n"),  # over --max-n (16)
    ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "x"}], "reasoning_effort": "huge"}),
     "reasoning_effort"),
])
def test_400_bodies(serve_server, path, raw, param):
    status, _, body = call(serve_server, "POST", path, raw=raw)
    assert status == 400 and body["error"]["type"] == "invalid_request_error" and body["error"]["param"] == param
    assert set(body["error"]) == {"message", "type", "param", "code"} and body["error"]["message"]


def test_401_on_a_wrong_or_missing_key(serve_server):
    for key in ("wrong-key", ""):
        with pytest.raises(openai.AuthenticationError) as e:
            openai.OpenAI(base_url=serve_server.url + "/v1", api_key=key or "x" * 0 + "-", max_retries=0).models.list()
        assert e.value.status_code == 401 and e.value.body["type"] == "authentication_error"
    status, _, body = call(serve_server, "POST", "/v1/completions", {"prompt": "hi"}, key=False)
    assert status == 401 and body["error"]["code"] == "invalid_api_key"


def test_a_stage_killed_mid_stream_is_replayed_and_the_stream_goes_on(serve_server, client, engine):
    ids = list(range(400, 430))
    want = solo(engine, ids, 24, Sampling(temperature=0.8, seed=3))
    stream = client.completions.create(model="tiny", prompt=ids, max_tokens=24, temperature=0.8, seed=3, stream=True,
                                       logprobs=0, extra_body={"return_tokens_as_token_ids": True})
    got = []
    for chunk in stream:
        if chunk.choices and chunk.choices[0].logprobs:
            got += token_ids_of(chunk.choices[0].logprobs.tokens)
        if len(got) == 3:
            stages = [pid for pid, cmd in serve_server.descendants() if "BackboneStageActor" in cmd]
            assert stages, "no stage actor process found under the server"
            os.kill(stages[-1], signal.SIGKILL)
    assert got == want
    r = client.completions.create(model="tiny", prompt=[1, 2, 3], max_tokens=2, temperature=0)
    assert r.choices[0].finish_reason in ("length", "stop")
    wait_idle(serve_server)
