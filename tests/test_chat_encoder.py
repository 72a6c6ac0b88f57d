"""The V4.1 chat encoder against the official encoder's prompts (tests/data/chat_golden.json,
written by tools/make_chat_golden.py) and its input checks."""
import json
from pathlib import Path

import pytest

from engramflow.chat import ChatOptions, encode_chat
from engramflow.chat.messages import ChatError

GOLDEN = json.loads((Path(__file__).parent / "data" / "chat_golden.json").read_text(encoding="utf-8"))


def _options(req: dict) -> ChatOptions:
    return ChatOptions(thinking=req["thinking"], reasoning_effort=req.get("reasoning_effort"), tools=req.get("tools"))


@pytest.mark.parametrize("case", GOLDEN["encode"], ids=[c["name"] for c in GOLDEN["encode"]])
def test_prompt_equals_official_encoder(case):
    assert encode_chat(case["request"]["messages"], _options(case["request"])) == case["prompt"]


def test_golden_covers_the_format():
    names = {c["name"] for c in GOLDEN["encode"]}
    assert {"tools_no_system_thinking", "tool_results_thinking", "multi_turn_thinking_drops_old_reasoning"} <= names
    dropped = next(c for c in GOLDEN["encode"] if c["name"] == "multi_turn_thinking_drops_old_reasoning")
    assert "old thoughts" not in dropped["prompt"]  # the oracle really dropped it


@pytest.mark.parametrize("messages, options, param", [
    ([{"role": "robot", "content": "x"}], ChatOptions(), "messages[0].role"),
    ([], ChatOptions(), "messages"),
    ("hello", ChatOptions(), "messages"),
    ([{"role": "user", "content": 5}], ChatOptions(), "messages[0].content"),
    ([{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "x"}}]}], ChatOptions(),
     "messages[0].content[0]"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], ChatOptions(),
     "messages[0].content[0].image_url"),
    ([{"role": "user", "content": "x"}], ChatOptions(reasoning_effort="huge"), "reasoning_effort"),
    ([{"role": "user", "content": "x"}], ChatOptions(reasoning_effort=101), "reasoning_effort"),
    ([{"role": "user", "content": "x"}], ChatOptions(reasoning_effort=True), "reasoning_effort"),
    ([{"role": "user", "content": "x"}], ChatOptions(tools=[{"type": "function"}]), "tools[0]"),
    ([{"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": "{bad"}}]}],
     ChatOptions(), "messages[0].tool_calls[0]"),
])
def test_bad_requests_name_the_field(messages, options, param):
    with pytest.raises(ChatError) as e:
        encode_chat(messages, options)
    assert e.value.param == param
