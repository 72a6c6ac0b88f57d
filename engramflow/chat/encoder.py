"""Chat turns -> the V4.1 prompt text.

Thinking mode: the generation header ends in `<think>` (the model reasons first) or, with
thinking off, in `</think>`; the reasoning effort is written once at the start, in a system
block. Earlier turns' reasoning is dropped in thinking mode (only the turns after the last
user message keep theirs) -- unless the conversation has tools, where the model needs its
earlier reasoning about the calls it made.
"""
from __future__ import annotations

import dataclasses
import json

from engramflow.chat import tokens as T
from engramflow.chat.messages import ChatError, Turn, to_turns
from engramflow.chat.pieces import Piece, Pieces, joined


@dataclasses.dataclass(frozen=True)
class ChatOptions:
    thinking: bool = True
    reasoning_effort: str | int | None = None  # "low" | "high" | "xhigh" | "max" | 1..100 (default "high")
    tools: list | None = None  # request-level OpenAI tools


def effort_budget(effort) -> int:
    """The numeric budget of a reasoning effort, checked."""
    if effort is None:
        effort = T.DEFAULT_EFFORT
    if type(effort) is int and 1 <= effort <= 100:
        return effort
    if isinstance(effort, str) and effort in T.EFFORT_LEVELS:
        return T.EFFORT_LEVELS[effort]
    raise ChatError(f"reasoning_effort must be an integer in [1, 100] or one of "
                    f"{', '.join(T.EFFORT_LEVELS)}, got {effort!r}", "reasoning_effort")


def to_json(value) -> str:
    return json.dumps(value, ensure_ascii=False)


_TOOLS_HEAD, _TOOLS_TAIL = T.TOOLS_TEXT.split("{schemas}")


def tools_pieces(schemas: list[dict], where: str = "tools") -> Pieces:
    """The tools block: the format's instructions around the client's schemas (plain text)."""
    out = Pieces().fmt(_TOOLS_HEAD)
    for k, schema in enumerate(schemas):
        out.text(("\n" if k else "") + to_json(schema), f"{where}[{k}]")
    return out.fmt(_TOOLS_TAIL)


def render_tools(schemas: list[dict]) -> str:
    return joined(tools_pieces(schemas).items)


def render_calls(calls: list[tuple[str, dict]]) -> str:
    """Tool calls as the model writes them (a completion's DSML block)."""
    return joined(calls_pieces(calls, "tool_calls").items)


def calls_pieces(calls: list[tuple[str, dict]], where: str) -> Pieces:
    """An assistant's earlier tool calls in DSML: the markup is the format's, every name and
    value the client's."""
    out = Pieces().fmt(f"\n\n{T.CALLS_OPEN}\n")
    for j, (name, args) in enumerate(calls):
        at = f"{where}.tool_calls[{j}].function"
        out.fmt(("\n" if j else "") + f'{T.INVOKE_OPEN} name="').text(name, f"{at}.name").fmt('">\n')
        for i, (key, v) in enumerate(args.items()):
            out.fmt(("\n" if i else "") + f'{T.PARAM_OPEN} name="').text(key, f"{at}.arguments")
            out.fmt(f'" string="{"true" if isinstance(v, str) else "false"}">')
            out.text(v if isinstance(v, str) else to_json(v), f"{at}.arguments").fmt(T.PARAM_CLOSE)
        out.fmt(f"\n{T.INVOKE_CLOSE}")
    return out.fmt(f"\n{T.CALLS_CLOSE}")


def _asks_reply(turns: list[Turn], i: int) -> bool:
    """A user-side turn: the assistant answers it (a system turn counts after the first)."""
    return turns[i].role in ("user", "developer") or (turns[i].role == "system" and i > 0)


def last_user_index(turns: list[Turn]) -> int:
    return max((i for i in range(len(turns)) if _asks_reply(turns, i)), default=-1)


def drop_old_thinking(turns: list[Turn]) -> list[Turn]:
    """Before the last user turn: assistant turns lose their reasoning, developer turns go."""
    last = last_user_index(turns)
    out = []
    for i, t in enumerate(turns):
        if i >= last or t.role in ("user", "system"):
            out.append(t)
        elif t.role == "assistant":
            out.append(dataclasses.replace(t, reasoning=""))
    return out


class _Renderer:
    def __init__(self, turns: list[Turn], thinking: bool, drop: bool, budget: int):
        self.turns, self.thinking, self.drop, self.budget = turns, thinking, drop, budget
        self.last_user = last_user_index(turns)

    def turn(self, i: int) -> Pieces:
        t, out = self.turns[i], Pieces()
        effort = T.EFFORT_TEXT.format(budget=self.budget) if i == 0 and self.thinking else ""
        out.fmt((T.SYSTEM if i == 0 and (effort or t.role == "system") else "") + effort)
        if t.role == "system":
            out.fmt(T.SYSTEM if i > 0 else "").text(t.content, f"{t.where}.content").extend(self._tools(t))
        elif t.role == "developer":
            out.fmt(T.USER).text(t.content, f"{t.where}.content").extend(self._tools(t))
        elif t.role == "user":
            out.fmt(T.USER)
            for k, (kind, text, where) in enumerate(t.blocks):
                out.fmt("\n\n" if k else "")
                if kind == "image":
                    out.image()
                elif kind == "tool_result":
                    out.fmt("<tool_result>").text(text, where).fmt("</tool_result>")
                else:
                    out.text(text, where)
        else:  # assistant
            if self.thinking and (not self.drop or i > self.last_user):
                out.text(t.reasoning, f"{t.where}.reasoning_content").fmt(T.THINK_END)
            out.text(t.content, f"{t.where}.content")
            out.extend(calls_pieces(t.calls, t.where) if t.calls else Pieces()).fmt(T.EOS)
        return out.fmt(self._header(i))

    @staticmethod
    def _tools(t: Turn) -> Pieces:
        return Pieces().fmt("\n\n").extend(tools_pieces(t.tools, t.tools_where)) if t.tools else Pieces()

    def _header(self, i: int) -> str:
        """The assistant's generation header after a user-side turn that the assistant answers
        next (or last, when the prompt asks for the reply)."""
        nxt = self.turns[i + 1].role if i + 1 < len(self.turns) else None
        if nxt not in (None, "assistant") or not _asks_reply(self.turns, i):
            return ""
        opens = self.thinking and (not self.drop or i >= self.last_user)
        return T.ASSISTANT + (T.THINK_START if opens else T.THINK_END)


def encode_chat_pieces(messages, options: ChatOptions = ChatOptions()) -> list[Piece]:
    """OpenAI-style messages -> the V4.1 prompt as pieces (format, client text, image slots);
    `encode_chat` is their text."""
    budget = effort_budget(options.reasoning_effort)
    turns = to_turns(messages, options.tools)
    drop = options.thinking and not any(t.tools for t in turns)
    if drop:
        turns = drop_old_thinking(turns)
    r = _Renderer(turns, options.thinking, drop, budget)
    out = Pieces().fmt(T.BOS)
    for i in range(len(turns)):
        out.extend(r.turn(i))
    return out.items


def encode_chat(messages, options: ChatOptions = ChatOptions()) -> str:
    """OpenAI-style messages -> the V4.1 prompt text (begins with BOS)."""
    return joined(encode_chat_pieces(messages, options))
