"""The server under hostile input, through the real `engramflow serve` process (the session's
shared server: tiny checkpoint, 2 stages) with the real `openai` client and raw HTTP:

* special tokens written into any message field reach the model as plain text (the prompt's
  token count is the plain-text count, computed apart by tests/prompt_oracle.py);
* every malformed body of the hostile review (and more of its kind) is a 400 with OpenAI's
  error body naming the field, never a 500;
* a 12 MB message and a 250-image bomb sent while a stream runs are refused at once, and
  neither the stream's token gaps nor /health's latency move (measured and printed; the only
  assertion is a generous bound: the review measured 15 s stalls);
* every socket the server and its Ray processes listen on is loopback;
* a Serve replica killed mid-stream is replaced, its pipeline adopted (same stage processes,
  same answers), and the server serves again (the time is printed).
"""
import base64
import http.client
import io
import json
import os
import signal
import statistics
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

import openai
import pytest

from engramflow.chat import ChatOptions
from engramflow.io.tokenizer_file import load_checkpoint_tokenizer
from injection_cases import INJECTED, role_cases
from prompt_oracle import expected_ids
from test_serve import wait_idle

GENEROUS_S = 5.0  # a bound that only a stall (the review: 15 s) or a hang crosses
REPLACED_WITHIN_S = 60.0  # a killed replica's replacement serves within this (measured 7-18 s on the shared 2-core box)


@pytest.fixture(scope="module")
def client(serve_server):
    return openai.OpenAI(base_url=serve_server.url + "/v1", api_key=serve_server.key, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tok(tiny_ckpt):
    return load_checkpoint_tokenizer(tiny_ckpt)


def post(server, path: str, raw: bytes, timeout: float = 60.0):
    """(status, error body or JSON, seconds) of a raw POST."""
    u = urlparse(server.url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    t = time.perf_counter()
    conn.request("POST", path, raw, {"Content-Type": "application/json", "Authorization": f"Bearer {server.key}"})
    resp = conn.getresponse()
    data = resp.read()
    elapsed = time.perf_counter() - t
    conn.close()
    return resp.status, json.loads(data) if data else None, elapsed


def chat_body(**extra) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1} | extra


@pytest.mark.parametrize("role", sorted(role_cases("x")))
def test_special_tokens_in_every_field_reach_the_model_as_plain_text(client, tok, role):
    messages, tools, thinking = role_cases(INJECTED)[role]
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=1, temperature=0,
                                       **({"tools": tools} if tools else {}),
                                       extra_body={"chat_template_kwargs": {"thinking": thinking}})
    want = len(expected_ids(tok, messages, ChatOptions(thinking=thinking, tools=tools), INJECTED))
    print(f"{role}: {r.usage.prompt_tokens} prompt tokens (plain-text count {want})")
    assert r.usage.prompt_tokens == want


def _deep(n: int) -> bytes:
    return b"[" * n + b"]" * n


_USER = b'"messages": [{"role": "user", "content": "Hi"}]'
_CALL_WITH_ID = '{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "", ' \
                '"tool_calls": [{"id": %s, "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}'
_TOOL = '{"messages": [{"role": "user", "content": "Hi"}], "tools": [{"type": "function", "function": %s}]}'
MALFORMED = [  # (name, path, raw body, the param the 400 names)
    ("nested_100k", "/v1/chat/completions", _deep(100_000), None),
    ("array_1500_deep_in_unknown_field", "/v1/chat/completions", b'{' + _USER + b', "extra": ' + _deep(1500) + b'}',
     None),
    ("array_100_deep_in_unknown_field", "/v1/chat/completions", b'{' + _USER + b', "extra": ' + _deep(100) + b'}',
     "extra" + "[0]" * 63),  # the first level past the limit
    ("integer_5000_digits", "/v1/chat/completions", b'{' + _USER + b', "extra": ' + b"7" * 5000 + b'}', "extra"),
    ("max_tokens_5000_digits", "/v1/chat/completions", b'{' + _USER + b', "max_tokens": ' + b"9" * 5000 + b'}',
     "max_tokens"),
    ("prompt_id_5000_digits", "/v1/completions", b'{"prompt": [' + b"1" * 5000 + b']}', "prompt[0]"),
    ("surrogate_in_chat_content", "/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}', "messages[0].content"),
    ("surrogate_in_completion_prompt", "/v1/completions", b'{"prompt": "x\\udfff"}', "prompt"),
    ("surrogate_in_tool_name", "/v1/chat/completions", (_TOOL % '{"name": "f\\ud83d"}').encode(),
     "tools[0].function.name"),
    ("surrogate_in_a_key", "/v1/chat/completions", b'{' + _USER + b', "k\\udc00": 1}', None),
    ("tool_call_id_list", "/v1/chat/completions", (_CALL_WITH_ID % '["a"]').encode(), "messages[1].tool_calls[0].id"),
    ("tool_call_id_object", "/v1/chat/completions", (_CALL_WITH_ID % '{"a": 1}').encode(),
     "messages[1].tool_calls[0].id"),
    ("tool_call_id_in_tool_message_list", "/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": "Hi"}, {"role": "tool", "tool_call_id": [1], "content": "r"}]}',
     "messages[1].tool_call_id"),
    ("tool_description_number", "/v1/chat/completions", (_TOOL % '{"name": "f", "description": 5}').encode(),
     "tools[0].function.description"),
    ("tool_parameters_string", "/v1/chat/completions", (_TOOL % '{"name": "f", "parameters": "x"}').encode(),
     "tools[0].function.parameters"),
    ("nan_literal", "/v1/chat/completions", b'{' + _USER + b', "temperature": NaN}', "temperature"),
    ("infinity_temperature", "/v1/chat/completions", b'{' + _USER + b', "temperature": 1e999}', "temperature"),
    ("duplicate_key", "/v1/chat/completions", b'{' + _USER + b', ' + _USER + b'}', "messages"),
    ("invalid_utf8", "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', None),
    ("body_is_an_array", "/v1/chat/completions", b'[1, 2]', None),
    ("messages_is_an_object", "/v1/chat/completions", b'{"messages": {"role": "user"}}', "messages"),
    ("model_is_a_list", "/v1/chat/completions", b'{' + _USER + b', "model": ["tiny"]}', "model"),
    ("user_is_a_number", "/v1/chat/completions", b'{' + _USER + b', "user": 5}', "user"),
    ("max_tokens_float", "/v1/completions", b'{"prompt": "hi", "max_tokens": 5.0}', "max_tokens"),
    ("seed_string", "/v1/completions", b'{"prompt": "hi", "seed": "1"}', "seed"),
    ("response_format_unknown_type", "/v1/chat/completions",
     json.dumps(chat_body(response_format={"type": "xml"})).encode(), "response_format"),
    ("response_format_json_schema_bad_type", "/v1/chat/completions",
     json.dumps(chat_body(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {
         "type": "nope"}}})).encode(), "response_format.json_schema.schema"),
    ("response_format_string", "/v1/chat/completions", json.dumps(chat_body(response_format="text")).encode(),
     "response_format"),
    ("tool_choice_required", "/v1/chat/completions", json.dumps(chat_body(tool_choice="required")).encode(),
     "tool_choice"),
    ("tool_choice_named_missing", "/v1/chat/completions",
     json.dumps(chat_body(tool_choice={"type": "function", "function": {"name": "missing"}})).encode(), "tool_choice"),
    ("tool_choice_number", "/v1/chat/completions", json.dumps(chat_body(tool_choice=5)).encode(), "tool_choice"),
    ("parallel_tool_calls_string", "/v1/chat/completions", json.dumps(chat_body(parallel_tool_calls="yes")).encode(),
     "parallel_tool_calls"),
    ("stream_options_without_stream", "/v1/chat/completions",
     json.dumps(chat_body(stream_options={"include_usage": True})).encode(), "stream_options"),
    ("stream_options_with_stream_false", "/v1/completions",
     json.dumps({"prompt": "hi", "stream": False, "stream_options": {"include_usage": True}}).encode(),
     "stream_options"),
    ("logit_bias_key_with_underscore", "/v1/completions", json.dumps({"prompt": "hi", "logit_bias": {"5_0": 1}}).encode(),
     "logit_bias"),
    ("logit_bias_key_with_space", "/v1/completions", json.dumps({"prompt": "hi", "logit_bias": {" 5": 1}}).encode(),
     "logit_bias"),
    ("logit_bias_key_arabic_digit", "/v1/completions", json.dumps({"prompt": "hi", "logit_bias": {"٥": 1}}).encode(),
     "logit_bias"),
    ("image_placeholder_in_text", "/v1/chat/completions",
     json.dumps({"messages": [{"role": "user", "content": "<｜deepseek_image｜>"}]}).encode(), "messages[0].content"),
    ("image_url_on_a_text_only_model", "/v1/chat/completions",
     json.dumps({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {
         "url": "data:image/png;base64,iVBORw0KGgo="}}]}]}).encode(), "messages"),
]


@pytest.mark.parametrize("name, path, raw, param", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_bodies_are_400s_naming_the_field(serve_server, name, path, raw, param):
    status, body, _ = post(serve_server, path, raw)
    assert status == 400, (status, body)
    assert set(body["error"]) == {"message", "type", "param", "code"} and body["error"]["message"]
    assert body["error"]["type"] == "invalid_request_error" and body["error"]["param"] == param, body


def test_the_fields_values_that_are_served_are_accepted(client):
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=1,
                                       response_format={"type": "text"}, tool_choice="auto", parallel_tool_calls=True,
                                       tools=[{"type": "function", "function": {"name": "f"}}], user="u")
    assert r.choices[0].finish_reason in ("length", "stop", "tool_calls")
    r = client.completions.create(model="tiny", prompt="hi", max_tokens=1, logit_bias={"50": 1})
    assert r.choices[0].finish_reason in ("length", "stop")


def test_a_body_past_the_size_limit_is_a_413(serve_server):
    from engramflow.serve.limits import Limits

    raw = b'{"prompt": "' + b"x" * (Limits.max_body_bytes + 1) + b'"}'
    status, body, seconds = post(serve_server, "/v1/completions", raw)
    print(f"{len(raw) / 1e6:.1f} MB body: {status} in {seconds:.2f} s")
    assert status == 413 and body["error"]["code"] == "request_too_large"


class _Stream(threading.Thread):
    """A long completion stream; the arrival time of each token."""

    def __init__(self, server):
        super().__init__(daemon=True)
        self.server, self.times, self.done = server, [], False

    def run(self):
        u = urlparse(self.server.url)
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=120)
        body = {"prompt": [5, 6, 7], "max_tokens": 2000, "stream": True, "temperature": 0,
                "logit_bias": {"11932": 100}}
        conn.request("POST", "/v1/completions", json.dumps(body),
                     {"Content-Type": "application/json", "Authorization": f"Bearer {self.server.key}"})
        resp = conn.getresponse()
        while not self.done:
            line = resp.readline()
            if not line or line.startswith(b"data: [DONE]"):
                break
            if line.startswith(b"data: "):
                self.times.append(time.perf_counter())
        conn.sock.close()
        conn.close()


class _Health(threading.Thread):
    """/health every 50 ms: (when asked, seconds to answer)."""

    def __init__(self, server):
        super().__init__(daemon=True)
        self.server, self.samples, self.done = server, [], False

    def run(self):
        u = urlparse(self.server.url)
        while not self.done:
            t = time.perf_counter()
            conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
            conn.request("GET", "/health")
            conn.getresponse().read()
            conn.close()
            self.samples.append((t, time.perf_counter() - t))
            time.sleep(0.05)


def start_probes(stream: _Stream, health: _Health) -> None:
    """The stream running 10 tokens in and /health sampled for 2 s: the baseline a test disturbs."""
    stream.start()
    while len(stream.times) < 10:
        time.sleep(0.05)
    health.start()
    time.sleep(2.0)


def _bomb_png() -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("1", (8000, 8000)).save(buf, "PNG")  # 64 Mpixel declared, a few kB on the wire
    return buf.getvalue()


def _gaps(times, lo, hi):
    return [b - a for a, b in zip(times, times[1:]) if lo <= b <= hi]


def test_oversized_requests_are_refused_without_stalling_a_running_stream(serve_server):
    wait_idle(serve_server)
    url = "data:image/png;base64," + base64.b64encode(_bomb_png()).decode()
    big = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "word " * 2_400_000}]}).encode()
    bomb = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}} for _ in range(250)]}]}).encode()
    stream, health = _Stream(serve_server), _Health(serve_server)
    start_probes(stream, health)
    t0 = time.perf_counter()
    results = {"12 MB message": post(serve_server, "/v1/chat/completions", big),
               "250-image bomb": post(serve_server, "/v1/chat/completions", bomb)}
    t1 = time.perf_counter()
    time.sleep(1.0)
    stream.done = health.done = True
    stream.join(30)
    health.join(30)
    before, during = _gaps(stream.times, t0 - 2.0, t0), _gaps(stream.times, t0, t1 + 0.5)
    h_before = [s for t, s in health.samples if t0 - 2.0 <= t < t0]
    h_during = [s for t, s in health.samples if t0 <= t <= t1 + 0.5]
    for name, (status, body, seconds) in results.items():
        print(f"{name}: {status} ({body['error']['code']}) in {seconds * 1000:.0f} ms")
    print(f"stream gap: median {statistics.median(before) * 1000:.1f} ms, max {max(before) * 1000:.1f} ms before; "
          f"median {statistics.median(during) * 1000:.1f} ms, max {max(during) * 1000:.1f} ms during ({len(during)} gaps)")
    print(f"/health: median {statistics.median(h_before) * 1000:.1f} ms, max {max(h_before) * 1000:.1f} ms before; "
          f"median {statistics.median(h_during) * 1000:.1f} ms, max {max(h_during) * 1000:.1f} ms during")
    for name, (status, body, seconds) in results.items():
        assert status == 400 and set(body["error"]) == {"message", "type", "param", "code"}, (name, body)
        assert seconds < GENEROUS_S, name
    assert results["12 MB message"][1]["error"]["code"] == "context_length_exceeded"
    assert results["250-image bomb"][1]["error"]["code"] == "too_many_images"
    assert during and max(during) < GENEROUS_S and h_during and max(h_during) < GENEROUS_S
    wait_idle(serve_server)


def _loopback(hex_addr: str) -> bool:
    raw = bytes.fromhex(hex_addr)
    if len(raw) == 4:
        return raw[::-1][0] == 127  # /proc/net/tcp: little-endian words
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
    return words == bytes(15) + b"\x01" or (words[:12] == bytes(10) + b"\xff\xff" and words[12] == 127)


def listening_sockets(pids) -> list[tuple[str, int, int, str]]:
    """(hex address, port, pid, process) of every listening TCP socket the processes hold."""
    owner = {}
    for pid in pids:
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    owner[target[8:-1]] = pid
        except OSError:
            continue
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A" and f[9] in owner:  # state LISTEN
                addr, port = f[1].split(":")
                name = Path(f"/proc/{owner[f[9]]}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
                out.append((addr, int(port, 16), owner[f[9]], name))
    return out


def test_the_server_and_its_ray_listen_on_loopback_only(serve_server):
    pids = [serve_server.proc.pid] + [pid for pid, _ in serve_server.descendants()]
    sockets = listening_sockets(pids)
    print(f"{len(sockets)} listening sockets: " + ", ".join(f"{name.rsplit('/', 1)[-1][:30]}:{port}"
                                                            for _, port, _, name in sockets))
    assert urlparse(serve_server.url).port in {port for _, port, _, _ in sockets}
    wide = [s for s in sockets if not _loopback(s[0])]
    assert not wide, f"listening beyond loopback: {wide}"


def test_a_killed_replica_is_replaced_and_serving_goes_on(serve_server):
    """Last in this file: the session's server goes on with the new replica. Killed mid-stream:
    that stream ends; the new replica adopts the dead one's pipeline (serve/keeper.py: the same
    stage processes, none of its sessions) and answers as the old one did. The time until a
    request is served again is printed; its bound is generous (16-24 s before adoption)."""
    wait_idle(serve_server)
    procs = serve_server.descendants()
    replicas = [pid for pid, cmd in procs if "ServeReplica" in cmd]
    stages = sorted(pid for pid, cmd in procs if "BackboneStageActor" in cmd)
    assert replicas and stages, "no Serve replica or stage actor under the server"
    body = json.dumps({"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 6, "temperature": 0, "logprobs": 0,
                       "return_tokens_as_token_ids": True}).encode()
    status, want, _ = post(serve_server, "/v1/completions", body)
    assert status == 200
    stream = _Stream(serve_server)
    stream.start()
    while len(stream.times) < 3:
        time.sleep(0.02)
    os.kill(replicas[0], signal.SIGKILL)
    t0 = time.perf_counter()
    status, attempts = None, []
    while time.perf_counter() - t0 < 180:
        try:
            status, got, _ = post(serve_server, "/v1/completions", body, timeout=30)
        except OSError as e:
            status = type(e).__name__
        attempts.append(f"{time.perf_counter() - t0:.1f}s:{status}")
        if status == 200:
            break
        time.sleep(0.1)
    seconds = time.perf_counter() - t0
    stream.join(60)
    print(f"replica killed mid-stream: serving again after {seconds:.1f} s; attempts: {' '.join(attempts)}; "
          f"the cut stream had {len(stream.times)} events")
    assert status == 200 and seconds < REPLACED_WITHIN_S
    assert not stream.is_alive(), "the stream cut by the kill never ended"
    assert got["choices"][0]["logprobs"]["tokens"] == want["choices"][0]["logprobs"]["tokens"]
    now = serve_server.descendants()
    assert not any(pid == replicas[0] for pid, _ in now)
    assert sorted(pid for pid, cmd in now if "BackboneStageActor" in cmd) == stages  # adopted, not relaunched
    wait_idle(serve_server)
