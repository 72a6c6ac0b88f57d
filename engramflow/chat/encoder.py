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


def render_tools(schemas: list[dict]) -> str:
    return T.TOOLS_TEXT.format(schemas="\n".join(to_json(s) for s in schemas))


def render_calls(calls: list[tuple[str, dict]]) -> str:
    invokes = []
    for name, args in calls:
        params = "\n".join(
            f'{T.PARAM_OPEN} name="{key}" string="{"true" if isinstance(v, str) else "false"}">'
            f'{v if isinstance(v, str) else to_json(v)}{T.PARAM_CLOSE}' for key, v in args.items())
        invokes.append(f'{T.INVOKE_OPEN} name="{name}">\n{params}\n{T.INVOKE_CLOSE}')
    return f"\n\n{T.CALLS_OPEN}\n" + "\n".join(invokes) + f"\n{T.CALLS_CLOSE}"


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

    def turn(self, i: int) -> str:
        t = self.turns[i]
        effort = T.EFFORT_TEXT.format(budget=self.budget) if i == 0 and self.thinking else ""
        out = (T.SYSTEM if i == 0 and (effort or t.role == "system") else "") + effort
        if t.role == "system":
            out += (T.SYSTEM if i > 0 else "") + t.content + self._tools(t)
        elif t.role == "developer":
            out += T.USER + t.content + self._tools(t)
        elif t.role == "user":
            out += T.USER + "\n\n".join(text if kind == "text" else f"<tool_result>{text}</tool_result>"
                                        for kind, text in t.blocks)
        else:  # assistant
            if self.thinking and (not self.drop or i > self.last_user):
                out += t.reasoning + T.THINK_END
            out += t.content + (render_calls(t.calls) if t.calls else "") + T.EOS
        return out + self._header(i)

    @staticmethod
    def _tools(t: Turn) -> str:
        return "\n\n" + render_tools(t.tools) if t.tools else ""

    def _header(self, i: int) -> str:
        """The assistant's generation header after a user-side turn that the assistant answers
        next (or last, when the prompt asks for the reply)."""
        nxt = self.turns[i + 1].role if i + 1 < len(self.turns) else None
        if nxt not in (None, "assistant") or not _asks_reply(self.turns, i):
            return ""
        opens = self.thinking and (not self.drop or i >= self.last_user)
        return T.ASSISTANT + (T.THINK_START if opens else T.THINK_END)


def encode_chat(messages, options: ChatOptions = ChatOptions()) -> str:
    """OpenAI-style messages -> the V4.1 prompt text (begins with BOS)."""
    budget = effort_budget(options.reasoning_effort)
    turns = to_turns(messages, options.tools)
    drop = options.thinking and not any(t.tools for t in turns)
    if drop:
        turns = drop_old_thinking(turns)
    r = _Renderer(turns, options.thinking, drop, budget)
    return T.BOS + "".join(r.turn(i) for i in range(len(turns)))
