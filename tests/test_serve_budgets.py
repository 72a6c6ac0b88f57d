"""Budgets checked before work, on the API app over a v41-small Engine (it has a vision tower,
which the shared tiny server lacks): an image whose header declares more pixels than the
server's budget is refused before any image is decoded, too many images before any is read;
and the prepare pool refuses at once past its bound instead of queueing without end."""
import asyncio
import base64
import io
import threading
import time

import pytest

from engramflow.serve.errors import ApiError
from engramflow.serve.limits import Limits
from engramflow.serve.prepare_pool import PreparePool


def _png(size, mode="1") -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new(mode, size).save(buf, "PNG")
    return buf.getvalue()


def _chat(urls) -> dict:
    return {"messages": [{"role": "user", "content": [{"type": "text", "text": "What is this?"}] + [
        {"type": "image_url", "image_url": {"url": u}} for u in urls]}], "max_tokens": 1}


def _url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


@pytest.mark.parametrize("count, size, code", [
    (1, (8000, 8000), "too_many_pixels"),                  # 64 Mpixel declared, a few kB sent
    (Limits.max_images, (8000, 8000), "too_many_pixels"),
    (Limits.max_images + 1, (8, 8), "too_many_images"),
    (250, (8000, 8000), "too_many_images"),
])
def test_image_budgets_are_checked_before_decoding(served_v41, count, size, code):
    client, _, _ = served_v41
    body = _chat([_url(_png(size))] * count)
    t = time.perf_counter()
    r = client.post("/v1/chat/completions", json=body)
    seconds = time.perf_counter() - t
    print(f"{count} images of {size[0]}x{size[1]}: {r.status_code} in {seconds * 1000:.0f} ms")
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == code and err["param"] == "messages", err
    assert seconds < 5.0  # generous: decoding 16 such images alone takes many seconds


def test_an_image_within_the_budget_is_served(served_v41):
    client, _, _ = served_v41
    r = client.post("/v1/chat/completions", json=_chat([_url(_png((64, 48), "RGB"))]))
    assert r.status_code == 200, r.json()


def test_prepare_pool_refuses_past_its_bound():
    pool, release = PreparePool(workers=1, queue=1), threading.Event()

    async def scenario():
        first = asyncio.ensure_future(pool.run(release.wait, 30))
        second = asyncio.ensure_future(pool.run(lambda: "queued"))
        await asyncio.sleep(0.05)
        with pytest.raises(ApiError) as e:
            await pool.run(lambda: "too many")
        assert e.value.status == 429 and e.value.headers == {"Retry-After": "1"}
        release.set()
        assert await first is True and await second == "queued"
        await asyncio.sleep(0.05)
        assert pool.busy == 0 and await pool.run(lambda: "again") == "again"

    try:
        asyncio.run(scenario())
    finally:
        release.set()
        pool.close()
