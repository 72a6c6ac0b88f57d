"""One request's output: tokens -> text (stop strings cut exactly) -> for chat, reasoning /
content / tool calls; and the events the HTTP side turns into responses or SSE chunks.

`Output` is the scheduler's sink: it runs on the scheduler's thread and hands each event to
the request's asyncio loop (thread-safe), so the scheduler never waits on a client.
"""
from __future__ import annotations

import asyncio
import dataclasses
import time

from engramflow.chat.parser import CompletionParser, Delta
from engramflow.model.sampling import Picked
from engramflow.serve.protocol import Settings
from engramflow.serve.text import Detokenizer, StopStrings


@dataclasses.dataclass
class Event:
    kind: str  # "delta" | "finish" | "error"
    delta: Delta = dataclasses.field(default_factory=Delta)  # completions: .content holds the text
    logprobs: list = dataclasses.field(default_factory=list)  # (token, logprob, [(token, logprob)])
    reason: str = ""
    message: str = ""
    index: int = 0  # the choice it belongs to (n > 1)


class Output:
    def __init__(self, settings: Settings, tokenizer, loop: asyncio.AbstractEventLoop, metrics=None, index: int = 0,
                 queue: asyncio.Queue | None = None):
        self.s, self.tok, self.loop, self.metrics, self.index = settings, tokenizer, loop, metrics, index
        self.queue: asyncio.Queue[Event] = asyncio.Queue() if queue is None else queue  # shared by a request's choices
        self.detok = Detokenizer(tokenizer, settings.prompt_ids[-4:])
        self.stops = StopStrings(settings.stop)
        self.parser = CompletionParser(settings.thinking) if settings.chat else None
        self.tokens: list[int] = []
        self.pending_logprobs: list = []
        self.saw_tool_calls = False
        self.done = False
        self.t0 = time.perf_counter()
        self.t_last: float | None = None

    # -- the scheduler's thread ---------------------------------------------------------------
    def on_token(self, picked: Picked) -> str | None:
        self._time()
        self.tokens.append(picked.token)
        if self.s.logprobs:
            self.pending_logprobs.append((self._piece(picked.token), picked.logprob,
                                          [(self._piece(t), lp) for t, lp in zip(picked.top_tokens, picked.top_logprobs)]))
        text, stopped = self.stops.feed(self.detok.add(picked.token))
        if stopped:
            self._emit(text, final=True)
            self.done = True
            self._put(Event("finish", reason="stop"))
            return "stop"
        self._emit(text)
        if len(self.tokens) >= self.s.max_tokens:
            return "length"
        return None

    def on_finish(self, reason: str) -> None:
        if self.done:  # a stop string ended it already
            return
        if reason != "cancelled":
            text, stopped = self.stops.feed(self.detok.flush())
            self._emit(text + ("" if stopped else self.stops.flush()), final=True)
        self.done = True
        self._put(Event("finish", reason=reason))

    def on_error(self, message: str) -> None:
        self._put(Event("error", message=message))

    def _emit(self, text: str, final: bool = False) -> None:
        delta = Delta(content=text) if self.parser is None else self.parser.feed(text)
        if final and self.parser is not None:
            delta.add(self.parser.finish())
        self.saw_tool_calls |= bool(delta.tool_calls)
        if delta or self.pending_logprobs and (text or final):
            lps, self.pending_logprobs = self.pending_logprobs, []
            self._put(Event("delta", delta=delta, logprobs=lps))

    def _piece(self, token: int) -> str:
        if self.s.token_ids:  # vLLM's return_tokens_as_token_ids
            return f"token_id:{token}"
        return self.tok.decode([token], skip_special_tokens=False)

    def _time(self) -> None:
        now = time.perf_counter()
        if self.metrics is not None:
            if self.t_last is None:
                self.metrics.first_token((now - self.t0) * 1e3)
            else:
                self.metrics.inter_token((now - self.t_last) * 1e3)
        self.t_last = now

    def _put(self, event: Event) -> None:
        event.index = self.index
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, event)
        except RuntimeError:  # the request's loop is gone (server shutting down)
            pass
