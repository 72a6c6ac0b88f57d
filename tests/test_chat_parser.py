"""The V4.1 completion parser against the official parser's results (tests/data/chat_golden.json),
whole and fed piece by piece (as a stream decodes), markers split at every position."""
import json
import random
from pathlib import Path

import pytest

from engramflow.chat import CompletionParser, parse_completion
from engramflow.chat.parser import Delta
from engramflow.chat import tokens as T

GOLDEN = json.loads((Path(__file__).parent / "data" / "chat_golden.json").read_text(encoding="utf-8"))
CASES = GOLDEN["parse"]


def _expected(case):
    p = case["parsed"]
    return {"content": p["content"], "reasoning_content": p["reasoning_content"], "tool_calls": p["tool_calls"]}


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_whole_completion_equals_official_parse(case):
    assert parse_completion(case["text"], case["mode"] == "thinking") == _expected(case)


def _streamed(text: str, cuts: list[int], thinking: bool) -> dict:
    p = CompletionParser(thinking)
    total = Delta()
    for a, b in zip([0] + cuts, cuts + [len(text)]):
        total.add(p.feed(text[a:b]))
    total.add(p.finish())
    return {"content": total.content, "reasoning_content": total.reasoning,
            "tool_calls": [{"type": "function", "function": c} for c in total.tool_calls]}


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_streamed_in_pieces_equals_whole(case):
    text, thinking = case["text"], case["mode"] == "thinking"
    rng = random.Random(0)
    for _ in range(30):
        cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 40))))
        assert _streamed(text, cuts, thinking) == _expected(case)
    # one character at a time: every marker split at every position
    assert _streamed(text, list(range(1, len(text))), thinking) == _expected(case)


def test_no_marker_prefix_leaks_into_a_delta():
    p = CompletionParser(thinking=True)
    assert p.feed("abc</thi").reasoning == "abc"  # "</thi" could be the end marker: held back
    d = p.feed("nk>x\n\n<｜DSML")
    assert (d.reasoning, d.content) == ("", "x")
    assert p.feed("｜ calls>\n").content == ""


def test_truncated_output_is_flushed_as_written():
    p = CompletionParser(thinking=True)
    d = p.feed("still thinking </th")
    d.add(p.finish())
    assert (d.reasoning, d.content) == ("still thinking </th", "")
    half_call = "ok" + T.CALLS_START + '>\n<｜DSML｜ invoke name="f">\n'
    assert parse_completion(half_call, thinking=False) == {"content": half_call, "reasoning_content": "",
                                                            "tool_calls": []}


def test_malformed_invoke_is_content_not_a_call():
    bad = T.CALLS_START + '>\n<｜DSML｜ invoke nam="f">\n</｜DSML｜ invoke>\n' + T.CALLS_CLOSE
    out = parse_completion(bad, thinking=False)
    assert out["tool_calls"] == [] and 'invoke nam="f"' in out["content"]
