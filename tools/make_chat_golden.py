"""Produce tests/data/chat_golden.json: V4.1 chat prompts and completion parses written by the
official encoder, the oracle the project's own encoder (engramflow/chat/) is checked against.

NEEDS the official reference folder (default ``../shared/official_v41`` relative to the
repository root; pass another path as the first argument), whose ``encoding_dsv41.py`` is
imported at run time only; none of its code is copied here. A one-off generator: NOT part of
the engramflow package and NOT imported or run by the tests (a fresh clone has no ``../shared``).

Usage (from the repository root):
    python3 tools/make_chat_golden.py ../shared/official_v41

Each encode case holds a chat request as a client sends it (`messages`, optional request-level
`tools`, `thinking`, `reasoning_effort`) and the oracle's prompt string. Request-level tools go
into the first system message, and an empty system message is added first when there is none:
the script does that before calling the oracle, the project's encoder does it itself. Each
parse case holds a completion text (as the model writes it, ending in the EOS token), the mode
and the oracle's parse (content, reasoning_content, OpenAI tool_calls).
"""
from __future__ import annotations

import copy
import hashlib
import importlib.util
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(REPO, "tests", "data", "chat_golden.json")
SOURCE = "sgl-project/sglang python/sglang/srt/entrypoints/openai/encoding_dsv41.py at commit 0e43c224"

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}
SEARCH = {"type": "function", "function": {
    "name": "search", "description": "Search the web (ünïcode ok)",
    "parameters": {"type": "object", "properties": {"query": {"type": "string"}, "filters": {"type": "object"}}}}}
CALLS = [{"id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}},
         {"id": "call_b", "type": "function", "function": {"name": "search",
                                                             "arguments": '{"query": "Louvre hours", "filters": {"lang": ["fr", "en"]}}'}}]

ENCODE = [
    ("chat_single_user", dict(messages=[{"role": "user", "content": "Hello!"}], thinking=False)),
    ("thinking_default_effort", dict(messages=[{"role": "user", "content": "What is 2+2?"}], thinking=True)),
    ("thinking_system_user", dict(messages=[{"role": "system", "content": "You are terse."},
                                            {"role": "user", "content": "Name a prime."}], thinking=True)),
    ("thinking_effort_low", dict(messages=[{"role": "user", "content": "Hi"}], thinking=True, reasoning_effort="low")),
    ("thinking_effort_max", dict(messages=[{"role": "user", "content": "Hi"}], thinking=True, reasoning_effort="max")),
    ("thinking_effort_int", dict(messages=[{"role": "user", "content": "Hi"}], thinking=True, reasoning_effort=7)),
    ("chat_system_user", dict(messages=[{"role": "system", "content": "Be kind."},
                                        {"role": "user", "content": "Hello"}], thinking=False)),
    ("multi_turn_thinking_drops_old_reasoning", dict(messages=[
        {"role": "user", "content": "First question"},
        {"role": "assistant", "content": "First answer", "reasoning_content": "old thoughts"},
        {"role": "user", "content": "Second question"}], thinking=True)),
    ("multi_turn_chat", dict(messages=[
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"}], thinking=False)),
    ("tools_no_system_thinking", dict(messages=[{"role": "user", "content": "Weather in Paris?"}],
                                      tools=[WEATHER, SEARCH], thinking=True)),
    ("tools_with_system_chat", dict(messages=[{"role": "system", "content": "Use tools."},
                                              {"role": "user", "content": "Weather in Paris?"}],
                                    tools=[WEATHER], thinking=False)),
    ("tool_results_thinking", dict(messages=[
        {"role": "user", "content": "Weather in Paris and Louvre hours?"},
        {"role": "assistant", "content": "", "reasoning_content": "need tools", "tool_calls": CALLS},
        {"role": "tool", "tool_call_id": "call_b", "content": "9-18"},
        {"role": "tool", "tool_call_id": "call_a", "content": "sunny"}], tools=[WEATHER, SEARCH], thinking=True)),
    ("tool_results_then_user_chat", dict(messages=[
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Let me check.", "tool_calls": CALLS[:1]},
        {"role": "tool", "tool_call_id": "call_a", "content": "rain"},
        {"role": "assistant", "content": "It rains."},
        {"role": "user", "content": "Thanks"}], tools=[WEATHER], thinking=False)),
    ("mid_conversation_system", dict(messages=[
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b", "reasoning_content": "r"},
        {"role": "system", "content": "new rule"}], thinking=True)),
    ("consecutive_users_and_text_parts", dict(messages=[
        {"role": "user", "content": [{"type": "text", "text": "part one"}, {"type": "text", "text": "part two"}]},
        {"role": "user", "content": "again"}], thinking=False)),
    ("developer_message", dict(messages=[
        {"role": "developer", "content": "dev rules"},
        {"role": "user", "content": "go"}], thinking=True, reasoning_effort="xhigh")),
    ("assistant_history_thinking_kept_with_tools", dict(messages=[
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1", "reasoning_content": "t1"},
        {"role": "user", "content": "q2"}], tools=[SEARCH], thinking=True)),
]

PARSE = [
    ("thinking_content", "thinking", "Let me think.\nIt is 4.</think>The answer is 4.<｜end▁of▁sentence｜>"),
    ("chat_content", "chat", "Hello there! How can I help?<｜end▁of▁sentence｜>"),
    ("thinking_tool_call", "thinking",
     'I should call the tool.</think>Checking.\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="get_weather">\n'
     '<｜DSML｜ parameter name="city" string="true">Paris</｜DSML｜ parameter>\n'
     '<｜DSML｜ parameter name="days" string="false">3</｜DSML｜ parameter>\n'
     '</｜DSML｜ invoke>\n</｜DSML｜ calls><｜end▁of▁sentence｜>'),
    ("chat_two_tool_calls", "chat",
     '\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="get_weather">\n'
     '<｜DSML｜ parameter name="city" string="true">Zürich "old town"</｜DSML｜ parameter>\n'
     '</｜DSML｜ invoke>\n<｜DSML｜ invoke name="search">\n'
     '<｜DSML｜ parameter name="query" string="true">a\nb</｜DSML｜ parameter>\n'
     '<｜DSML｜ parameter name="filters" string="false">{"lang": ["fr"]}</｜DSML｜ parameter>\n'
     '</｜DSML｜ invoke>\n</｜DSML｜ calls><｜end▁of▁sentence｜>'),
    ("thinking_empty_reasoning", "thinking", "</think>Direct.<｜end▁of▁sentence｜>"),
]


def load_oracle(folder: str):
    path = os.path.join(folder, "encoding_dsv41.py")
    spec = importlib.util.spec_from_file_location("encoding_dsv41_oracle", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    with open(path, "rb") as f:
        return mod, hashlib.sha256(f.read()).hexdigest()


def oracle_messages(case: dict) -> list:
    """Request-level tools into the first system message (one added when there is none)."""
    messages = copy.deepcopy(case["messages"])
    if case.get("tools"):
        if not messages or messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": ""})
        messages[0]["tools"] = case["tools"]
    return messages


def main() -> None:
    folder = sys.argv[1] if len(sys.argv) > 1 else os.path.join(REPO, "..", "shared", "official_v41")
    enc, sha = load_oracle(folder)
    encode = []
    for name, case in ENCODE:
        prompt = enc.encode_messages(oracle_messages(case), thinking_mode="thinking" if case["thinking"] else "chat",
                                     reasoning_effort=case.get("reasoning_effort"))
        encode.append({"name": name, "request": case, "prompt": prompt})
    parse = [{"name": name, "mode": mode, "text": text,
              "parsed": enc.parse_message_from_completion_text(text, thinking_mode=mode)} for name, mode, text in PARSE]
    data = {"provenance": {"source": SOURCE, "sha256": sha, "command": "python3 tools/make_chat_golden.py ../shared/official_v41",
                           "note": "outputs of the official V4.1 encoder; its code is not in this repository"},
            "encode": encode, "parse": parse}
    with open(OUT, "w", encoding="utf-8") as f:
        json.dump(data, f, ensure_ascii=False, indent=1)
        f.write("\n")
    print(f"wrote {OUT}: {len(encode)} prompts, {len(parse)} parses")


if __name__ == "__main__":
    main()
