"""From tokens to OpenAI bodies and stream chunks, with the real tokenizer, the chat parser
and the response builders (no model: the tokens are those of a known completion): reasoning,
content and tool calls; finish_reason tool_calls; usage; stop strings; logprobs."""
import asyncio
import json

import pytest

from engramflow.chat import tokens as T
from engramflow.io.tokenizer_file import load_checkpoint_tokenizer
from engramflow.model.sampling import Picked, Sampling
from engramflow.serve import api
from engramflow.serve.output import Output
from engramflow.serve.protocol import Settings
from engramflow.serve.responses import Envelope

COMPLETION = ('Need the weather.</think>Checking.' + T.CALLS_START + '>\n<｜DSML｜ invoke name="get_weather">\n'
              '<｜DSML｜ parameter name="city" string="true">Paris</｜DSML｜ parameter>\n'
              '<｜DSML｜ parameter name="days" string="false">2</｜DSML｜ parameter>\n'
              '</｜DSML｜ invoke>\n' + T.CALLS_CLOSE)
WANT_CALL = {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}


@pytest.fixture(scope="module")
def tok(v41_small_preset):
    return load_checkpoint_tokenizer(v41_small_preset)


def _run(tok, settings, text, reason="stop", consume=None):
    """Feed the completion's tokens as the scheduler would, then build the response."""
    async def go():
        out = Output(settings, tok, asyncio.get_running_loop())
        ended = None
        for t in tok.encode(text, add_special_tokens=False).ids:
            ended = out.on_token(Picked(t, -0.5, (t,), (-0.5,)))
            if ended:
                break
        out.on_finish(ended or reason)
        return await consume(out)
    return asyncio.run(go())


def _settings(chat=True, stream=False, **kw):
    return Settings([0, 5, 6], 1000, Sampling(), chat=chat, thinking=True, stream=stream, **kw)


def test_whole_chat_response_with_reasoning_and_tool_calls(tok):
    s = _settings()
    body = _run(tok, s, COMPLETION, consume=lambda out: api._whole(_One(out), s, Envelope(True, "m")))
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    msg = choice["message"]
    assert (msg["reasoning_content"], msg["reasoning"], msg["content"]) == ("Need the weather.",) * 2 + ("Checking.",)
    assert [c["function"] for c in msg["tool_calls"]] == [WANT_CALL] and msg["tool_calls"][0]["id"].startswith("call")
    n = len(tok.encode(COMPLETION, add_special_tokens=False).ids)
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": 3 + n}


def _chunks(gen):
    async def collect():
        return [line async for line in gen]
    return collect()


def test_streamed_chat_deltas_add_up_and_end_with_done(tok):
    s = _settings(stream=True, include_usage=True)
    lines = _run(tok, s, COMPLETION, consume=lambda out: _chunks(api._stream(_One(out), s, Envelope(True, "m"))))
    assert lines[-1] == "data: [DONE]\n\n"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Need the weather."
    assert "".join(d.get("content", "") for d in deltas) == "Checking."
    calls = [tc for d in deltas for tc in d.get("tool_calls", [])]
    assert [c["function"] for c in calls] == [WANT_CALL] and calls[0]["index"] == 0
    assert chunks[-2]["choices"][0]["finish_reason"] == "tool_calls"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["prompt_tokens"] == 3


class _One:
    """A request's choices (serve/choices.py) when it has one: what api's _whole and _stream read."""

    def __init__(self, out):
        self.outputs, self.queue = [out], out.queue
        self.cached_tokens = None  # no prefix cache

    @property
    def completion_tokens(self) -> int:
        return len(self.outputs[0].tokens)

    def cancel(self):
        pass


def test_completion_stop_string_and_logprobs(tok):
    s = Settings([0, 5], 1000, Sampling(), stop=["wor"], logprobs=True, top_logprobs=1)
    body = _run(tok, s, "hello world and more", consume=lambda out: api._whole(_One(out), s, Envelope(False, "m")))
    choice = body["choices"][0]
    assert choice["text"] == "hello " and choice["finish_reason"] == "stop"
    lp = choice["logprobs"]
    assert lp["token_logprobs"] == [-0.5] * len(lp["tokens"]) and lp["text_offset"][0] == 0
    assert "".join(lp["tokens"]).startswith("hello wor")  # the tokens read until the stop was seen
