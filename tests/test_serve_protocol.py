"""Request bodies -> generation settings: vLLM's V4.1 thinking convention, the checks that
make a 400 name its field, and the length limits."""
import pytest

from engramflow.chat import ChatOptions, encode_chat
from engramflow.chat import tokens as T
from engramflow.serve import protocol
from engramflow.serve.errors import ApiError

USER = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("extra, thinking, effort", [
    ({}, True, None),
    ({"chat_template_kwargs": {"thinking": False}}, False, None),
    ({"chat_template_kwargs": {"enable_thinking": False}}, False, None),
    ({"reasoning_effort": "none"}, False, None),
    ({"reasoning_effort": "max"}, True, "max"),
    ({"chat_template_kwargs": {"reasoning_effort": 30}}, True, 30),
])
def test_thinking_follows_vllms_convention(extra, thinking, effort):
    prompt, options = protocol.chat_prompt({"messages": USER} | extra)
    assert (options.thinking, options.reasoning_effort) == (thinking, effort)
    assert prompt == encode_chat(USER, ChatOptions(thinking=thinking, reasoning_effort=effort))
    assert prompt.endswith(T.ASSISTANT + (T.THINK_START if thinking else T.THINK_END))


def test_request_tools_go_into_a_new_first_system_message_unless_tool_choice_none():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    prompt, _ = protocol.chat_prompt({"messages": USER, "tools": tools})
    assert prompt.startswith(T.BOS + T.SYSTEM) and '{"name": "f"' in prompt
    prompt, _ = protocol.chat_prompt({"messages": USER, "tools": tools, "tool_choice": "none"})
    assert '{"name": "f"' not in prompt


@pytest.mark.parametrize("body, param", [
    ({"n": 17}, "n"),  # over max_n (16)
    ({"n": 0}, "n"),
    ({"temperature": "hot"}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_k": 1.5}, "top_k"),
    ({"seed": "x"}, "seed"),
    ({"stop": 5}, "stop"),
    ({"stream": "yes"}, "stream"),
    ({"logit_bias": {"999999": 1}}, "logit_bias"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_completion_tokens": 98}, "max_completion_tokens"),  # with the 3-token prompt: past the length
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"echo": True}, "echo"),
])
def test_bad_fields_are_400s_naming_them(body, param):
    with pytest.raises(ApiError) as e:
        protocol.common(body, [1, 2, 3], 100, 1000, None)
    assert e.value.status == 400 and e.value.param == param and e.value.body()["error"]["message"]


def test_lengths_and_defaults():
    s = protocol.common({}, [1, 2, 3], 100, 1000, None)
    assert s.max_tokens == 97 and s.sampling.temperature == 1.0  # chat: up to the model's length
    assert protocol.common({}, [1, 2, 3], 100, 1000, 16).max_tokens == 16  # completions: OpenAI's 16
    with pytest.raises(ApiError) as e:
        protocol.common({}, list(range(100)), 100, 1000, None)
    assert e.value.code == "context_length_exceeded"
    s = protocol.common({"seed": 7, "temperature": 0, "stop": "x", "stream": True,
                         "stream_options": {"include_usage": True}}, [1], 100, 1000, None)
    assert (s.sampling.seed, s.sampling.greedy, s.stop, s.stream, s.include_usage) == (7, True, ["x"], True, True)


@pytest.mark.parametrize("prompt, ok", [("text", True), ([1, 2], True), (["one"], True), ([[1, 2]], True),
                                        ("", False), ([], False), (["a", "b"], False), ([1, "x"], False)])
def test_completion_prompts(prompt, ok):
    if ok:
        assert protocol.completion_prompt({"prompt": prompt})
    else:
        with pytest.raises(ApiError):
            protocol.completion_prompt({"prompt": prompt})
