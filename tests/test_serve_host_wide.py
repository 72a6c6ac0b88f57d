"""`engramflow serve --host 0.0.0.0 --allow-remote-images`, a real process on v41-small (conftest's
`wide_server`, 1 stage; its `--max-restarts 0` is test_serve_recovery.py's, which runs after):

* the API listens on every interface (answers at this machine's own non-loopback address), the
  startup output says so, and nothing else widens: every other socket the server and its Ray
  listen on (GCS, raylet, workers, metrics exporter, keeper, replica) is loopback, and the GCS
  port refuses a connection at the non-loopback address;
* a remote image its host drips out slowly is fetched off the event loop: a stream running
  meanwhile keeps its token pace and /health its latency (measured and printed; the only
  assertion is a generous bound: the fetch takes 6 s, a stall shows as one gap that long).
"""
import http.client
import socket
import statistics
import threading
import time
import types
from pathlib import Path

import openai
import pytest

from slow_http import DripServer
from test_serve import wait_idle
from test_serve_hostile import _gaps, _Health, _loopback, _Stream, listening_sockets, start_probes
from v41_vision_golden import IMAGES

DRIP_S = 6.0  # the remote image's host sends it over this long (under the fetch deadline, 10 s)
GENEROUS_S = DRIP_S / 2  # a stream gap or /health answer this long means the fetch stalled the loop


@pytest.fixture(scope="module")
def wide(wide_server):
    wide_server.stderr = Path(wide_server.log.name)
    wide_server.local = types.SimpleNamespace(url=f"http://127.0.0.1:{wide_server.port}", key=wide_server.key)
    return wide_server


def _own_address() -> str | None:
    """This machine's non-loopback IPv4 address (the one its default route leaves from)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # TEST-NET: no packet is sent, the kernel picks the source
        except OSError:
            return None
        addr = s.getsockname()[0]
    return None if addr.startswith("127.") else addr


def _wildcard(hex_addr: str) -> bool:
    return set(hex_addr) == {"0"}


def test_host_0000_widens_the_api_alone_and_says_so(wide):
    assert wide.url == f"http://0.0.0.0:{wide.port}"  # the startup JSON line names the address bound
    err = wide.stderr.read_text()
    assert "the API listens on 0.0.0.0, reachable beyond this machine" in err, err[-2000:]
    assert "the local Ray instance and its metrics stay on 127.0.0.1" in err

    pids = [wide.proc.pid] + [pid for pid, _ in wide.descendants()]
    sockets = listening_sockets(pids)
    api = [s for s in sockets if s[1] == wide.port]
    others = [s for s in sockets if s[1] != wide.port]
    print(f"API: {[(a, p) for a, p, _, _ in api]}; {len(others)} other listening sockets: "
          + ", ".join(f"{n.rsplit('/', 1)[-1][:24]}:{p}" for _, p, _, n in others))
    assert api and all(_wildcard(a) for a, _, _, _ in api)
    wide_others = [s for s in others if not _loopback(s[0])]
    assert not wide_others, f"listening beyond loopback: {wide_others}"

    own = _own_address()
    if own is None:
        pytest.skip("this machine has no non-loopback address to reach the API at (sockets checked above)")
    conn = http.client.HTTPConnection(own, wide.port, timeout=30)
    conn.request("GET", "/health")
    assert conn.getresponse().status == 200
    conn.close()
    gcs = next(p for _, p, _, n in others if "gcs_server" in n)
    with socket.socket() as s, pytest.raises(ConnectionRefusedError):
        s.settimeout(10)
        s.connect((own, gcs))
    print(f"/health answered at {own}:{wide.port}; the GCS port {gcs} refused there")


def test_a_slow_remote_image_does_not_stall_a_running_stream(wide):
    wait_idle(wide.local)
    drip = DripServer((IMAGES / "rgb_small.png").read_bytes(), seconds=DRIP_S)
    client = openai.OpenAI(base_url=wide.local.url + "/v1", api_key=wide.key, max_retries=0, timeout=120)
    stream, health = _Stream(wide.local), _Health(wide.local)
    result = {}

    def slow_image_chat():
        t = time.perf_counter()
        r = client.chat.completions.create(model="v41-small", max_tokens=1, temperature=0, messages=[
            {"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                         {"type": "image_url", "image_url": {"url": drip.url}}]}])
        result.update(seconds=time.perf_counter() - t, prompt_tokens=r.usage.prompt_tokens)

    try:
        start_probes(stream, health)
        t0 = time.perf_counter()
        chat = threading.Thread(target=slow_image_chat, daemon=True)
        chat.start()
        chat.join(120)
        time.sleep(0.5)
    finally:
        stream.done = health.done = True
        stream.join(30)
        health.join(30)
        drip.close()
    assert drip.finished, "the image was never fetched whole"
    t1 = drip.finished[0]  # the fetch window: from the request until its image's last byte
    before, during = _gaps(stream.times, t0 - 2.0, t0), _gaps(stream.times, t0 + 0.2, t1)
    h_before = [s for t, s in health.samples if t0 - 2.0 <= t < t0]
    h_during = [s for t, s in health.samples if t0 + 0.2 <= t <= t1]
    print(f"image chat: {result} (the host dripped it over {t1 - t0:.1f} s)")
    print(f"stream gap: median {statistics.median(before) * 1000:.1f} ms, max {max(before) * 1000:.1f} ms before; "
          f"median {statistics.median(during) * 1000:.1f} ms, max {max(during) * 1000:.1f} ms while fetching "
          f"({len(during)} gaps)")
    print(f"/health: median {statistics.median(h_before) * 1000:.1f} ms, max {max(h_before) * 1000:.1f} ms before; "
          f"median {statistics.median(h_during) * 1000:.1f} ms, max {max(h_during) * 1000:.1f} ms while fetching")
    assert result.get("prompt_tokens", 0) > 30  # served, the image as its span (the text alone is ~10 tokens)
    assert t1 - t0 > DRIP_S * 0.8  # the fetch really was slow
    assert len(during) > 10 and max(during) < GENEROUS_S  # the stream went on through the fetch
    assert h_during and max(h_during) < GENEROUS_S
    wait_idle(wide.local)
