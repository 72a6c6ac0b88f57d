"""OpenAI response bodies and stream chunks from a request's events."""
from __future__ import annotations

import secrets
import time

from engramflow.serve.output import Event
from engramflow.serve.protocol import Settings


def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


def usage(s: Settings, completion_tokens: int, cached_tokens: int | None = None) -> dict:
    """OpenAI's usage; cached_tokens: prompt tokens taken from the prefix cache, not prefilled
    (None: the server keeps no prefix cache, and the details are left out, as vLLM does)."""
    n = len(s.prompt_ids)
    out = {"prompt_tokens": n, "completion_tokens": completion_tokens, "total_tokens": n + completion_tokens}
    if cached_tokens is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return out


def finish_reason(reason: str, tool_calls: bool) -> str:
    return "tool_calls" if tool_calls and reason == "stop" else reason


def _bytes(text: str) -> list[int]:
    return list(text.encode("utf-8", "surrogatepass"))


def chat_logprobs(entries: list, top: int) -> dict:
    return {"content": [{"token": t, "logprob": lp, "bytes": _bytes(t),
                         "top_logprobs": [{"token": tt, "logprob": tl, "bytes": _bytes(tt)} for tt, tl in tops[:top]]}
                        for t, lp, tops in entries]}


def completion_logprobs(entries: list, top: int, offset: int) -> dict:
    offsets = []
    for t, _, _ in entries:
        offsets.append(offset)
        offset += len(t)
    return {"tokens": [t for t, _, _ in entries], "token_logprobs": [lp for _, lp, _ in entries],
            "top_logprobs": [dict(tops[:top]) for _, _, tops in entries], "text_offset": offsets}


class ToolCallIds:
    """OpenAI ids and indices of a response's tool calls, in order."""

    def __init__(self):
        self.count = 0

    def stream_deltas(self, calls: list[dict]) -> list[dict]:
        out = []
        for c in calls:
            out.append({"index": self.count, "id": new_id("call"), "type": "function",
                        "function": {"name": c["name"], "arguments": c["arguments"]}})
            self.count += 1
        return out


def chat_delta(event: Event, ids: ToolCallIds) -> dict:
    d = event.delta
    out = {}
    if d.reasoning:
        out["reasoning_content"] = out["reasoning"] = d.reasoning  # DeepSeek's name and vLLM's
    if d.content:
        out["content"] = d.content
    if d.tool_calls:
        out["tool_calls"] = ids.stream_deltas(d.tool_calls)
    return out


class Envelope:
    """The fields every body or chunk of one response shares."""

    def __init__(self, chat: bool, model: str):
        self.chat, self.model = chat, model
        self.id = new_id("chatcmpl" if chat else "cmpl")
        self.created = int(time.time())

    def body(self, choices: list, **extra) -> dict:
        obj = "chat.completion" if self.chat else "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices} | extra

    def chunk(self, choices: list, **extra) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices} | extra
