"""Tool calls end to end through `engramflow serve`'s application on the session's Ray
(serve_server.ServeApp), with the real `openai` client.

The model is the tiny reference checkpoint with a script in its Engram memory
(scripted_checkpoint.py): greedy decoding after this chat prompt writes a DSML tool-call block
and EOS, through the real lookup, projection, gate, blocks and head on a 2-stage pipeline. The
server must parse that block into OpenAI `tool_calls`, whole and as stream deltas, and finish
with finish_reason "tool_calls"."""
import json

import openai
import pytest

from engramflow.chat import tokens as T
from engramflow.chat.encoder import render_calls
from engramflow.io.tokenizer_file import load_checkpoint_tokenizer
from engramflow.pipeline.engine import Engine
from engramflow.serve.protocol import chat_prompt
from scripted_checkpoint import script_checkpoint
from serve_server import ServeApp

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}]
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]
# one parameter: a second one would repeat the 4-gram `DSML| parameter name="` with another
# successor, which a 4-gram memory cannot script
CALL = ("get_weather", {"city": "Paris"})
REQUEST = dict(model="tiny", messages=MESSAGES, tools=TOOLS, temperature=0, max_tokens=80,
               extra_body={"chat_template_kwargs": {"thinking": False}})


@pytest.fixture(scope="module")
def scripted(tiny_ckpt, tmp_path_factory):
    """The tiny checkpoint scripted to answer MESSAGES with CALL; the completion's token ids."""
    tok = load_checkpoint_tokenizer(tiny_ckpt)
    text, _ = chat_prompt({"messages": MESSAGES, "tools": TOOLS, "chat_template_kwargs": {"thinking": False}})
    prompt = tok.encode(text, add_special_tokens=False).ids
    completion = tok.encode(render_calls([CALL]), add_special_tokens=False).ids + [tok.token_to_id(T.EOS)]
    ckpt = script_checkpoint(tiny_ckpt, tmp_path_factory.mktemp("scripted") / "ckpt", prompt, completion)
    return ckpt, prompt, completion


@pytest.fixture(scope="module")
def server(serve_http, scripted, tmp_path_factory):
    s = ServeApp(serve_http, scripted[0], tmp_path_factory.mktemp("serve-tools"), "tools", stages=2)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=server.key, max_retries=0, timeout=300)


def test_the_script_is_what_greedy_decoding_writes(scripted):
    """The premise, checked in process: the Engine's greedy tokens are the tool-call block."""
    ckpt, prompt, completion = scripted
    engine = Engine(ckpt, backbone="reference")
    s = engine.open()
    out = [int(engine.prefill(s, prompt).argmax())]
    while len(out) < len(completion) + 4 and out[-1] != completion[-1]:
        out.append(int(engine.decode_step({s: out[-1]})[s].argmax()))
    engine.close(s)
    assert out == completion


def test_tool_calls_parsed_from_the_model_output(client):
    r = client.chat.completions.create(**REQUEST)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert not choice.message.content
    calls = choice.message.tool_calls
    name, args = CALL
    assert [(c.type, c.function.name, json.loads(c.function.arguments)) for c in calls] == [("function", name, args)]
    assert calls[0].id.startswith("call")
    assert r.usage.completion_tokens > 10


def test_tool_calls_streamed_as_deltas(client):
    chunks = list(client.chat.completions.create(stream=True, **REQUEST))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    parts = [tc for d in deltas for tc in (d.tool_calls or [])]
    assert finish == ["tool_calls"]
    assert not "".join(d.content or "" for d in deltas)
    assert parts and {p.index for p in parts} == {0}
    name = "".join(p.function.name or "" for p in parts if p.function)
    arguments = "".join(p.function.arguments or "" for p in parts if p.function)
    assert (name, json.loads(arguments)) == CALL
    assert any(p.id and p.id.startswith("call") for p in parts)
