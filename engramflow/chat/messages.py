"""Chat messages as clients send them (OpenAI form) -> checked turns of the V4.1 format.

V4.1 has no tool role: a tool result is a `<tool_result>` block of a user turn, and a run of
user and tool messages is one user turn (its blocks joined by blank lines). Tool results in
one turn follow the order of the calls that asked for them. Everything a client can get wrong
is a `ChatError` naming the field, raised before any text is written.
"""
from __future__ import annotations

import dataclasses
import json

from engramflow.chat import tokens as T
from engramflow.errors import EngramflowError

ROLES = ("system", "user", "assistant", "tool", "developer")


class ChatError(EngramflowError):
    """A request the chat format cannot encode; `param` names the offending field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclasses.dataclass
class Turn:
    role: str
    content: str = ""
    # user turns: (kind, text, the request field it came from); kind "text", "tool_result" or "image"
    blocks: list[tuple[str, str, str]] = dataclasses.field(default_factory=list)
    reasoning: str = ""
    calls: list[tuple[str, dict]] = dataclasses.field(default_factory=list)  # assistant: (name, arguments)
    call_ids: list[str] = dataclasses.field(default_factory=list)
    tools: list[dict] = dataclasses.field(default_factory=list)  # function schemas
    where: str = ""  # the message's field (messages[k]); its text fields are named from it
    tools_where: str = "tools"  # the field the tools came from


def _text(content, where: str, allow_none: bool = True) -> str:
    """A message content: a string, or a list of text parts (joined by blank lines)."""
    if content is None and allow_none:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n\n".join(_part_text(p, f"{where}[{k}]") for k, p in enumerate(content))
    raise ChatError(f"{where} must be a string or a list of content parts, got {type(content).__name__}", where)


def _part_text(part, where: str) -> str:
    if not isinstance(part, dict) or not isinstance(part.get("type"), str):
        raise ChatError(f"{where} must be an object with a 'type'", where)
    if part["type"] != "text":
        raise ChatError(f"{where}: content part type {part['type']!r} is not served (text only)", where)
    if not isinstance(part.get("text"), str):
        raise ChatError(f"{where}.text must be a string", where)
    return part["text"]


def _image_url(part, where: str) -> str | None:
    """An OpenAI `image_url` part's URL (None for any other part)."""
    if not isinstance(part, dict) or part.get("type") != "image_url":
        return None
    spec = part.get("image_url")
    url = spec.get("url") if isinstance(spec, dict) else spec
    if not isinstance(url, str) or not url:
        raise ChatError(f"{where}.image_url.url must be a non-empty string", f"{where}.image_url")
    return url


def image_urls(messages) -> list[str]:
    """The user messages' image URLs in prompt order (one image placeholder each)."""
    urls = []
    for k, m in enumerate(messages if isinstance(messages, list) else []):
        if isinstance(m, dict) and m.get("role") == "user" and isinstance(m.get("content"), list):
            urls += [u for j, p in enumerate(m["content"]) if (u := _image_url(p, f"messages[{k}].content[{j}]"))]
    return urls


def function_schemas(tools, where: str = "tools") -> list[dict]:
    """OpenAI tools [{"type": "function", "function": {...}}] -> their function schemas."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise ChatError(f"{where} must be a list, got {type(tools).__name__}", where)
    out = []
    for k, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(fn, dict) \
                or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ChatError(f"{where}[{k}] must be {{'type': 'function', 'function': {{'name': ...}}}}", f"{where}[{k}]")
        for key, kind in (("description", str), ("parameters", dict), ("strict", bool)):
            if fn.get(key) is not None and not isinstance(fn[key], kind):
                raise ChatError(f"{where}[{k}].function.{key} must be a {_KIND_NAMES[kind]}",
                                f"{where}[{k}].function.{key}")
        out.append(fn)
    return out


_KIND_NAMES = {str: "string", dict: "JSON object", bool: "boolean"}


def _call(tc, where: str) -> tuple[str, dict, str]:
    fn = tc.get("function") if isinstance(tc, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ChatError(f"{where} must hold function.name", where)
    call_id = tc.get("id") if tc.get("id") is not None else fn.get("id")
    if call_id is not None and not isinstance(call_id, str):
        raise ChatError(f"{where}.id must be a string, got {type(call_id).__name__}", f"{where}.id")
    args = fn.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            raise ChatError(f"{where}.function.arguments is not valid JSON: {fn['arguments'][:80]!r}", where) from None
    if not isinstance(args, dict):
        raise ChatError(f"{where}.function.arguments must be a JSON object", where)
    return fn["name"], args, call_id or ""


def to_turns(messages, tools=None) -> list[Turn]:
    """Check and convert; request-level `tools` go into the first system message (one is
    added first when there is none)."""
    if not isinstance(messages, list) or not messages:
        raise ChatError("messages must be a non-empty list", "messages")
    turns = []
    for k, m in enumerate(messages):
        where = f"messages[{k}]"
        if not isinstance(m, dict):
            raise ChatError(f"{where} must be an object", where)
        role = m.get("role")
        if role not in ROLES:
            raise ChatError(f"{where}.role: unknown role {role!r} (one of {', '.join(ROLES)})", f"{where}.role")
        turns.append(_turn(role, m, where))
    schemas = function_schemas(tools)
    if schemas:
        if turns[0].role != "system":
            turns.insert(0, Turn("system"))
        turns[0].tools = turns[0].tools + schemas
        turns[0].tools_where = "tools"
    return sort_tool_results(merge_user_turns(turns))


def _turn(role: str, m: dict, where: str) -> Turn:
    if role == "tool":
        call_id = m.get("tool_call_id")
        if call_id is not None and not isinstance(call_id, str):
            raise ChatError(f"{where}.tool_call_id must be a string, got {type(call_id).__name__}",
                            f"{where}.tool_call_id")
        return Turn("tool", blocks=[("tool_result", _text(m.get("content"), f"{where}.content"), f"{where}.content")],
                    call_ids=[call_id or ""], where=where)
    if role == "user":
        content = m.get("content")
        if isinstance(content, list):  # image parts become image slots (image_urls() lists them)
            return Turn("user", blocks=[("image", T.IMAGE, f"{where}.content[{k}]")
                                        if _image_url(p, f"{where}.content[{k}]") is not None
                                        else ("text", _part_text(p, f"{where}.content[{k}]"), f"{where}.content[{k}]")
                                        for k, p in enumerate(content)], where=where)
        return Turn("user", blocks=[("text", _text(content, f"{where}.content"), f"{where}.content")], where=where)
    turn = Turn(role, content=_text(m.get("content"), f"{where}.content"),
                tools=function_schemas(m.get("tools"), f"{where}.tools"), where=where, tools_where=f"{where}.tools")
    if role == "developer" and not turn.content:
        raise ChatError(f"{where}: a developer message needs content", f"{where}.content")
    if role == "assistant":
        reasoning = m.get("reasoning_content", m.get("reasoning"))
        turn.reasoning = _text(reasoning, f"{where}.reasoning_content")
        calls = m.get("tool_calls") or []
        if not isinstance(calls, list):
            raise ChatError(f"{where}.tool_calls must be a list", f"{where}.tool_calls")
        for j, tc in enumerate(calls):
            name, args, call_id = _call(tc, f"{where}.tool_calls[{j}]")
            turn.calls.append((name, args))
            turn.call_ids.append(call_id)
    return turn


def merge_user_turns(turns: list[Turn]) -> list[Turn]:
    """Tool results become user blocks; consecutive user turns become one."""
    out: list[Turn] = []
    for t in turns:
        if t.role in ("user", "tool"):
            if out and out[-1].role == "user":
                out[-1].blocks += t.blocks
                out[-1].call_ids += t.call_ids
                continue
            t = dataclasses.replace(t, role="user")
        out.append(t)
    return out


def sort_tool_results(turns: list[Turn]) -> list[Turn]:
    """In each user turn, tool results take the order of the latest assistant's calls (stable;
    a result naming no known call sorts as the first call)."""
    order: dict[str, int] = {}
    for t in turns:
        if t.role == "assistant" and t.calls:
            order = {cid: k for k, cid in enumerate(t.call_ids) if cid}
        elif t.role == "user" and order:
            slots = [k for k, (kind, _, _) in enumerate(t.blocks) if kind == "tool_result"]
            if len(slots) > 1:
                ids = [cid for cid, (kind, _, _) in zip(_block_ids(t), t.blocks) if kind == "tool_result"]
                ranked = sorted(zip(ids, (t.blocks[k] for k in slots)), key=lambda p: order.get(p[0], 0))
                for k, (_, block) in zip(slots, ranked):
                    t.blocks[k] = block
    return turns


def _block_ids(t: Turn) -> list[str]:
    """The tool call id of each block of a merged user turn ("" for text blocks)."""
    ids, it = [], iter(t.call_ids)
    for kind, _, _ in t.blocks:
        ids.append(next(it, "") if kind == "tool_result" else "")
    return ids
