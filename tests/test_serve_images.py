"""Chat image parts on the V4.1 backbone (v41-small has a vision tower): the API app over an
in-process Engine, spoken to over HTTP in process. An `image_url` part with a data: URL gives
the tokens the Engine's `generate` gives for the same prompt and image; bad images, remote URLs
(not allowed by the operator) and a wrong part are 400s with OpenAI's error body."""
import base64
from pathlib import Path

import pytest

from engramflow.model.sampling import Sampling
from engramflow.pipeline.image_inputs import text_with_images
from engramflow.serve.protocol import chat_prompt

IMAGES = Path(__file__).parent / "data" / "v41_vision" / "images"


@pytest.fixture(scope="module")
def served(served_v41):
    return served_v41


def _data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def _messages(url: str) -> list:
    return [{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                         {"type": "image_url", "image_url": {"url": url}}]}]


def test_image_chat_tokens_equal_generate_with_the_image(served):
    client, backend, oracle = served
    image = (IMAGES / "rgb_small.png").read_bytes()
    messages = _messages(_data_url(image))
    body = {"model": "v41-small", "messages": messages, "max_tokens": 4, "temperature": 0,
            "logprobs": True, "return_tokens_as_token_ids": True}
    prompt, _ = chat_prompt(body)  # the server's own options (thinking as the request implies)
    assert prompt.count("<｜deepseek_image｜>") == 1  # the encoder writes the V4.1 placeholder for the part
    ids = text_with_images(prompt, backend.encode, backend.runner.vision_cfg)
    (g,) = oracle.generate([ids], max_new_tokens=4, sampling=Sampling(temperature=0.0), images=[[image]])
    eos = backend.tokenizer.token_to_id("<｜end▁of▁sentence｜>")
    want = g.tokens[:g.tokens.index(eos)] if eos in g.tokens else g.tokens
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    got = [int(e["token"].split(":")[1]) for e in r.json()["choices"][0]["logprobs"]["content"]]
    assert got == want
    assert r.json()["usage"]["prompt_tokens"] > len(ids)  # the image counts as its whole span
    assert backend.health()["sessions"] == 0


@pytest.mark.parametrize("url, code", [
    (_data_url(b"this is not an image at all"), None),
    ("data:image/png;base64,@@not-base64@@", "bad_source"),
    ("https://example.com/cat.png", "remote_refused"),
    ("ftp://example.com/cat.png", "bad_source"),
])
def test_bad_image_is_a_400_with_openai_error_body(served, url, code):
    client, backend, _ = served
    r = client.post("/v1/chat/completions", json={"model": "v41-small", "messages": _messages(url), "max_tokens": 2})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == "messages" and err["message"]
    if code is not None:
        assert err["code"] == code
    assert backend.health()["sessions"] == 0


def test_image_part_without_url_is_a_400(served):
    client, _, _ = served
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]
    r = client.post("/v1/chat/completions", json={"model": "v41-small", "messages": messages, "max_tokens": 2})
    assert r.status_code == 400 and "image_url" in r.json()["error"]["message"]
