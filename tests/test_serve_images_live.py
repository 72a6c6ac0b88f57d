"""Images through `engramflow serve`'s application (serve_server.ServeApp, on the session's Ray)
on v41-small, with the real `openai` client: an `image_url` part (data: URL) gives the tokens the
in-process Engine gives for the same prompt and image; a bad image is a 400 with OpenAI's error
body naming the problem, and the server goes on."""
import base64

import openai
import pytest

from engramflow.io.tokenizer_file import load_checkpoint_tokenizer
from engramflow.model.sampling import Sampling
from engramflow.pipeline.engine import Engine
from engramflow.pipeline.image_inputs import text_with_images
from engramflow.serve.protocol import chat_prompt
from serve_server import PREFILL_CHUNK
from test_serve import wait_idle
from vision_bad_images import bad_images
from v41_vision_golden import IMAGES


@pytest.fixture(scope="module")
def serve_server_v41(v41_app):
    """The server's application on v41-small (1 stage; it has a vision tower): conftest's."""
    return v41_app


@pytest.fixture(scope="module")
def client(serve_server_v41):
    return openai.OpenAI(base_url=serve_server_v41.url + "/v1", api_key=serve_server_v41.key, max_retries=0,
                         timeout=300)


def messages(data: bytes, mime: str = "image/png") -> list:
    url = f"data:{mime};base64,{base64.b64encode(data).decode()}"
    return [{"role": "user", "content": [{"type": "text", "text": "What is in this picture?"},
                                         {"type": "image_url", "image_url": {"url": url}}]}]


def test_image_chat_equals_engine_generate_with_the_image(client, serve_server_v41, v41_small_preset):
    image = (IMAGES / "rgb_small.png").read_bytes()
    msgs = messages(image)
    r = client.chat.completions.create(model="v41-small", messages=msgs, max_tokens=5, temperature=0, logprobs=True,
                                       extra_body={"return_tokens_as_token_ids": True})
    got = [int(c.token.split(":")[1]) for c in r.choices[0].logprobs.content]

    prompt, _ = chat_prompt({"messages": msgs})  # the prompt the server writes for these messages
    tok = load_checkpoint_tokenizer(v41_small_preset)
    e = Engine(v41_small_preset, prefill_chunk=PREFILL_CHUNK)
    try:
        ids = text_with_images(prompt, lambda t: tok.encode(t, add_special_tokens=False).ids, e.vision_cfg)
        tokens = e.generate([ids], max_new_tokens=5, sampling=Sampling(temperature=0.0), images=[[image]])[0].tokens
    finally:
        e.shutdown()
    eos = tok.token_to_id("<｜end▁of▁sentence｜>")
    assert got == (tokens[:tokens.index(eos)] if eos in tokens else tokens)
    assert r.usage.prompt_tokens > len(ids)  # the image counts as its whole span
    wait_idle(serve_server_v41)


@pytest.mark.parametrize("case", ["truncated", "not an image", "bomb above our limit", "absurd aspect"])
def test_bad_image_is_a_400_naming_the_problem(client, serve_server_v41, case):
    data, kind = bad_images()[case]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="v41-small", messages=messages(data), max_tokens=2)
    err = e.value.body
    assert e.value.status_code == 400 and err["type"] == "invalid_request_error" and err["param"] == "messages"
    assert err["code"] == kind and err["message"]  # the ImageError kind the image must raise
    wait_idle(serve_server_v41)
