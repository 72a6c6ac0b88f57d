"""When recovery gives up, as a real `engramflow serve` process (1 stage, v41-small) with
`--max-restarts 0` (conftest's `wide_server`, shared with test_serve_host_wide.py, which runs
first, as the file names sort): a stage killed mid-stream ends that stream with an error event; the replica then refuses
work with 503 + Retry-After and fails Ray Serve's health check, Serve replaces it with a new
replica (a new pipeline), and the server serves the next request."""
import os
import signal
import time

import pytest

from engramflow.model.sampling import Sampling
from engramflow.pipeline.engine import Engine
from serve_server import PREFILL_CHUNK
from test_serve import call, solo


MODEL = "v41-small"


@pytest.fixture(scope="module")
def server(wide_server):
    return wide_server


def stream_events(server, body):
    """The SSE `data:` payloads of a streamed completion, read as they come."""
    import http.client
    import json
    from urllib.parse import urlparse

    u = urlparse(server.url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=120)
    conn.request("POST", "/v1/completions", json.dumps(body | {"stream": True}),
                 {"Content-Type": "application/json", "Authorization": f"Bearer {server.key}"})
    resp = conn.getresponse()
    assert resp.status == 200
    try:
        for line in resp:
            line = line.decode().strip()
            if line.startswith("data: "):
                yield line[len("data: "):]
    finally:
        conn.close()


def test_retries_exhausted_end_the_stream_with_an_error_and_the_next_request_is_served(server, v41_small_preset):
    body = {"model": MODEL, "prompt": list(range(300, 320)), "max_tokens": 200, "temperature": 0}
    events, killed = [], False
    for data in stream_events(server, body):
        events.append(data)
        if len(events) == 3 and not killed:
            stages = [pid for pid, cmd in server.descendants() if "BackboneStageActor" in cmd]
            assert stages, "no stage actor process found under the server"
            os.kill(stages[-1], signal.SIGKILL)
            killed = True
    assert killed and events[-1] == "[DONE]"
    assert '"error"' in events[-2] and "restart budget" in events[-2]  # an error event, not a finish
    assert all('"finish_reason": "length"' not in e for e in events)

    # the spent replica refuses work until Serve has replaced it; then the next request is served
    deadline, statuses = time.monotonic() + 180, []
    while time.monotonic() < deadline:
        status, headers, out = call(server, "POST", "/v1/completions",
                                    {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0,
                                     "logprobs": 0, "return_tokens_as_token_ids": True})
        statuses.append(status)
        if status == 200:
            break
        assert status == 503, out
        if out is not None and "error" in out:  # our replica's body (Serve's own 503 while it swaps has none)
            assert out["error"]["code"] == "replica_restarting" and {k.lower(): v for k, v in headers.items()}.get("retry-after") == "5"
        time.sleep(1.0)
    assert statuses[-1] == 200, statuses
    e = Engine(v41_small_preset, prefill_chunk=PREFILL_CHUNK)
    want = solo(e, [5, 6, 7], 4, Sampling(temperature=0.0))
    e.shutdown()
    assert [int(t.split(":")[1]) for t in out["choices"][0]["logprobs"]["tokens"]] == want
