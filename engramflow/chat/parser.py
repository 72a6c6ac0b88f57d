"""Completion text -> reasoning, content and tool calls; incremental, for streaming.

The model writes (thinking mode) its reasoning up to `</think>`, then the content, then
optionally a DSML tool-call block, then EOS. `CompletionParser.feed` takes the text as it
is decoded and returns what is certain so far: text that could still be the start of a
marker is held back until the next piece shows what it is, so a marker split across tokens
is never leaked into the content. A tool call is handed out whole once its invoke closes.
A tool-call block that does not parse is handed back as content, as written.
"""
from __future__ import annotations

import dataclasses
import json
import re

from engramflow.chat import tokens as T

_INVOKE = re.compile(r'^>?\n?' + re.escape(T.INVOKE_OPEN) + r' name="(.*?)">\n(.*)$', re.DOTALL)
_PARAM = re.compile(re.escape(T.PARAM_OPEN) + r' name="(.*?)" string="(true|false)">(.*?)' + re.escape(T.PARAM_CLOSE),
                    re.DOTALL)


@dataclasses.dataclass
class Delta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[dict] = dataclasses.field(default_factory=list)  # {"name", "arguments" (JSON text)}

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)

    def add(self, other: "Delta") -> None:
        self.reasoning += other.reasoning
        self.content += other.content
        self.tool_calls += other.tool_calls


def _held(buf: str, markers: tuple[str, ...]) -> int:
    """Length of the longest tail of `buf` that is the start of a marker (it must wait)."""
    best = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(buf)), best, -1):
            if buf.endswith(m[:k]):
                best = k
                break
    return best


def _first(buf: str, markers: tuple[str, ...]) -> tuple[int, str | None]:
    hits = [(buf.find(m), m) for m in markers if m in buf]
    return min(hits) if hits else (-1, None)


def parse_invoke(text: str) -> dict | None:
    """One `<invoke ...>...` (without its close tag) -> {"name", "arguments"}; None if malformed."""
    m = _INVOKE.match(text.strip(" ") if text.startswith(">") else text.lstrip("\n"))
    if not m:
        return None
    name, body = m.groups()
    params = _PARAM.findall(body)
    if _PARAM.sub("", body).strip("\n") or len({p[0] for p in params}) != len(params):
        return None
    args = ", ".join(f"{json.dumps(k, ensure_ascii=False)}: {json.dumps(v, ensure_ascii=False) if s == 'true' else v}"
                     for k, s, v in params)
    return {"name": name, "arguments": "{" + args + "}"}


class CompletionParser:
    def __init__(self, thinking: bool):
        self.mode = "reasoning" if thinking else "content"
        self.buf = ""
        self.calls_raw = ""  # the tool-call block as written, for the fallback
        self.tool_calls: list[dict] = []

    def feed(self, text: str) -> Delta:
        self.buf += text
        out = Delta()
        while True:
            before = (self.mode, len(self.buf))
            getattr(self, f"_{self.mode}")(out)
            if (self.mode, len(self.buf)) == before:
                return out

    def finish(self) -> Delta:
        """The end of the completion: flush whatever was held back."""
        out = self.feed("")
        if self.mode == "reasoning":
            out.reasoning += self.buf
        elif self.mode == "content":
            out.content += self.buf
        elif self.mode == "calls":  # an unfinished block: what was written, as content
            out.content += T.CALLS_START + self.calls_raw + self.buf
        self.buf, self.mode = "", "done"
        return out

    def _reasoning(self, out: Delta) -> None:
        pos, _ = _first(self.buf, (T.THINK_END,))
        if pos >= 0:
            out.reasoning += self.buf[:pos]
            self.buf, self.mode = self.buf[pos + len(T.THINK_END):], "content"
        else:
            cut = len(self.buf) - _held(self.buf, (T.THINK_END,))
            out.reasoning += self.buf[:cut]
            self.buf = self.buf[cut:]

    def _content(self, out: Delta) -> None:
        markers = (T.CALLS_START, T.EOS)
        pos, marker = _first(self.buf, markers)
        if marker is not None:
            out.content += self.buf[:pos]
            self.buf = self.buf[pos + len(marker):]
            self.mode = "calls" if marker == T.CALLS_START else "done"
        else:
            cut = len(self.buf) - _held(self.buf, markers)
            out.content += self.buf[:cut]
            self.buf = self.buf[cut:]

    def _calls(self, out: Delta) -> None:
        pos, marker = _first(self.buf, (T.INVOKE_CLOSE, T.CALLS_CLOSE))
        if marker is None:
            return
        piece, self.buf = self.buf[:pos], self.buf[pos + len(marker):]
        self.calls_raw += piece + marker
        if marker == T.CALLS_CLOSE:
            if piece.strip("\n"):  # text between the last invoke and the close: not a call
                out.content += piece
            self.mode = "done"
            return
        call = parse_invoke(piece)
        if call is None:
            out.content += piece + marker
        else:
            self.tool_calls.append(call)
            out.tool_calls.append(call)

    def _done(self, out: Delta) -> None:
        self.buf = ""  # after EOS or the tool-call block: nothing more belongs to the message


def parse_completion(text: str, thinking: bool) -> dict:
    """A whole completion -> {"content", "reasoning_content", "tool_calls"} (OpenAI form)."""
    p = CompletionParser(thinking)
    d = p.feed(text)
    d.add(p.finish())
    return {"content": d.content, "reasoning_content": d.reasoning,
            "tool_calls": [{"type": "function", "function": c} for c in d.tool_calls]}
