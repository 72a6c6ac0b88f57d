"""Structured outputs, forced tool calls and n > 1 through the server's application on the
shared Ray (ServeApp, v41-small with random weights, 1 stage), with the real `openai` client:
every sampled JSON answer parses and validates against its schema, forced tool calls parse and
their arguments validate, n = 4 gives the four single-request runs of streams 0..3, a
constrained request does not change an unconstrained one decoded in the same steps, and bad
input is a 400 naming its field before anything is queued."""
import concurrent.futures as cf
import json

import jsonschema
import openai
import pytest

from structured_cases import CLOCK, SCHEMAS, TOOLS, WEATHER
from test_serve import wait_idle

MODEL = "v41-small"
ASK = [{"role": "user", "content": "Answer in JSON, please."}]
NO_THINKING = {"chat_template_kwargs": {"thinking": False}}


@pytest.fixture(scope="module")
def app(v41_app):
    return v41_app  # conftest's v41-small app (1 stage), shared with the image tests


@pytest.fixture(scope="module")
def client(app):
    return openai.OpenAI(base_url=app.url + "/v1", api_key=app.key, max_retries=0, timeout=600)


def chat(client, **kw):
    kw.setdefault("extra_body", {}).update(NO_THINKING)
    return client.chat.completions.create(model=MODEL, messages=kw.pop("messages", ASK), **kw)


def together(fn, args: list) -> list:
    """Run the requests at once (they share the server's steps); results in order."""
    with cf.ThreadPoolExecutor(len(args)) as pool:
        return list(pool.map(fn, args))


def token_ids(choice) -> list[int]:
    return [int(t.token.removeprefix("token_id:")) for t in choice.logprobs.content]


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_json_schema_answers_parse_and_validate(client, app, name):
    schema = SCHEMAS[name]
    fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}
    rs = together(lambda seed: chat(client, response_format=fmt, max_tokens=48, temperature=1.0, seed=seed),
                  list(range(20)))
    for r in rs:
        assert r.choices[0].finish_reason == "stop", r.choices[0]
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    assert len({r.choices[0].message.content for r in rs}) > 1  # sampled: not one answer twenty times
    wait_idle(app)


def test_vllm_structured_outputs_choice_and_regex(client):
    r = chat(client, max_tokens=8, seed=1, extra_body={"structured_outputs": {"choice": ["alpha", "beta"]}})
    assert r.choices[0].message.content in ("alpha", "beta")
    r = client.completions.create(model=MODEL, prompt="Code:", max_tokens=12, seed=2,
                                  extra_body={"structured_outputs": {"regex": "[A-F]{3}-[0-9]{2}"}})
    text = r.choices[0].text
    assert len(text) == 6 and set(text[:3]) <= set("ABCDEF") and text[3] == "-" and text[4:].isdigit()


def check_calls(choice, names: set[str]) -> list:
    assert choice.finish_reason == "tool_calls", choice
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for call in choice.message.tool_calls:
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    return choice.message.tool_calls


def test_tool_choice_required_gives_calls_that_validate(client, app):
    """The one tool has several parameters (a string, a bounded integer, an enum): each sampled
    call's arguments validate against its schema."""
    rs = together(lambda seed: chat(client, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False,
                                    max_tokens=400, temperature=1.0, seed=seed), list(range(3)))
    for r in rs:
        assert len(check_calls(r.choices[0], {"get_weather"})) == 1  # parallel_tool_calls: false
    wait_idle(app)


def test_named_tool_choice_calls_that_tool_streamed(client, app):
    named = {"type": "function", "function": {"name": "get_time"}}
    stream = chat(client, tools=TOOLS, tool_choice=named, max_tokens=200, seed=3, stream=True)
    calls, finish = [], None
    for chunk in stream:
        for c in chunk.choices:
            calls += c.delta.tool_calls or []
            finish = c.finish_reason or finish
    assert finish == "tool_calls" and [c.function.name for c in calls] == ["get_time"]
    jsonschema.validate(json.loads(calls[0].function.arguments), CLOCK["function"]["parameters"])
    wait_idle(app)


def test_n4_choices_are_the_single_runs_of_streams_0_to_3(client, app):
    kw = dict(max_tokens=6, temperature=1.0, seed=11, logprobs=True)
    r = chat(client, n=4, extra_body={"return_tokens_as_token_ids": True}, **kw)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    singles = [chat(client, extra_body={"return_tokens_as_token_ids": True, "sampling_stream": i}, **kw)
               for i in range(4)]
    assert [token_ids(c) for c in r.choices] == [token_ids(s.choices[0]) for s in singles]
    assert len({tuple(token_ids(c)) for c in r.choices}) == 4  # independent streams
    assert r.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)
    # streamed: each chunk names its choice; put back together, the same four texts
    texts = {}
    for chunk in chat(client, n=4, stream=True, **{k: v for k, v in kw.items() if k != "logprobs"}):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
    assert [texts[i] for i in range(4)] == [c.message.content for c in r.choices]
    wait_idle(app)


def test_n_with_a_schema_constrains_every_choice(client, app):
    schema = SCHEMAS["enums"]
    r = chat(client, n=3, max_tokens=48, seed=4, response_format={
        "type": "json_schema", "json_schema": {"name": "e", "schema": schema}})
    for c in r.choices:
        jsonschema.validate(json.loads(c.message.content), schema)
    wait_idle(app)


def test_a_constrained_neighbour_leaves_free_tokens_unchanged(client, app):
    free = dict(max_tokens=12, temperature=1.0, seed=21, logprobs=True, extra_body={"return_tokens_as_token_ids": True})
    alone = token_ids(chat(client, **free).choices[0])
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMAS["nested"]}}

    def one(k):  # constrained requests decode while the free one does: they share its steps
        return chat(client, **free) if k == 0 else chat(client, response_format=fmt, max_tokens=48, seed=k)
    rs = together(one, list(range(4)))
    assert token_ids(rs[0].choices[0]) == alone
    for r in rs[1:]:
        jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMAS["nested"])
    wait_idle(app)


BAD = [
    ("schema_type", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "nope"}}}}, "response_format.json_schema.schema"),
    ("unenforced_keyword", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"not": {"type": "string"}}}}}}}, "response_format.json_schema.schema"),
    ("response_format_type", {"response_format": {"type": "yaml"}}, "response_format"),
    ("regex", {"structured_outputs": {"regex": "[a-z"}}, "structured_outputs.regex"),
    ("two_structured_kinds", {"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ("ebnf", {"structured_outputs": {"grammar": 'start ::= "a"'}}, "structured_outputs.grammar"),
    ("n_over_max", {"n": 17}, "n"),
    ("unknown_tool", {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ("required_without_tools", {"tool_choice": "required"}, "tool_choice"),
    ("tool_schema", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer", "if": {}}}}}}], "tool_choice": "required"},
     "tools[0].function.parameters.properties.a"),
]


@pytest.mark.parametrize("fields, param", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_requests_are_400s_naming_the_field(client, app, fields, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, extra_body=fields)
    err = e.value.body
    assert e.value.status_code == 400 and err["type"] == "invalid_request_error" and err["message"]
    assert err["param"] == param, err
    wait_idle(app)  # nothing was queued
