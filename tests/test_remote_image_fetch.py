"""A remote image (serve --allow-remote-images) is fetched within a total deadline: a host that
drips its bytes cannot hold a prepare worker (and its request) for as long as it likes. Against
a real local HTTP server sending slowly (tests/slow_http.py)."""
import time

import pytest

from engramflow.model.v41.vision import ImageError, load_image_from_data_url
from slow_http import DripServer
from v41_vision_golden import IMAGES

GENEROUS_S = 5.0  # the deadline below is 1 s; only a fetch that ignores it takes this long


def test_a_slow_but_timely_image_arrives_whole():
    body = (IMAGES / "rgb_small.png").read_bytes()
    drip = DripServer(body, seconds=0.5, pieces=10)
    try:
        assert load_image_from_data_url(drip.url, allow_remote=True, timeout_s=10.0) == body
    finally:
        drip.close()


def test_an_image_dripping_past_the_deadline_is_refused_in_time():
    drip = DripServer((IMAGES / "rgb_small.png").read_bytes(), seconds=20.0, pieces=200)
    try:
        t = time.perf_counter()
        with pytest.raises(ImageError, match="did not arrive within 1 s") as e:
            load_image_from_data_url(drip.url, allow_remote=True, timeout_s=1.0)
        seconds = time.perf_counter() - t
        print(f"refused after {seconds:.2f} s (deadline 1 s, the host would take 20 s)")
        assert e.value.kind == "bad_source" and seconds < GENEROUS_S
    finally:
        drip.close()
