"""The chat path on the V4.1 backbone (v41-small): the API app over an in-process Engine,
spoken to over HTTP in process (the Ray Serve process is tests/test_serve.py's): a thinking
chat request's tokens equal the Engine's `generate` of the encoder's prompt."""
import pytest

from engramflow.chat import ChatOptions, encode_chat
from engramflow.model.sampling import Sampling


@pytest.fixture(scope="module")
def served(served_v41):
    return served_v41


def test_thinking_chat_tokens_equal_generate_on_v41(served):
    client, backend, oracle = served
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hi."}]
    ids = backend.encode(encode_chat(messages, ChatOptions(thinking=True, reasoning_effort="low")))
    want = oracle.generate([ids], max_new_tokens=5, sampling=Sampling(temperature=0.6, seed=4))[0].tokens
    eos = backend.tokenizer.token_to_id("<｜end▁of▁sentence｜>")
    want = want[:want.index(eos)] if eos in want else want
    r = client.post("/v1/chat/completions", json={
        "model": "v41-small", "messages": messages, "max_tokens": 5, "temperature": 0.6, "seed": 4,
        "reasoning_effort": "low", "logprobs": True, "return_tokens_as_token_ids": True})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert [int(e["token"].split(":")[1]) for e in choice["logprobs"]["content"]] == want
    assert "reasoning_content" in choice["message"] and r.json()["usage"]["prompt_tokens"] == len(ids)
    assert backend.health()["sessions"] == 0
