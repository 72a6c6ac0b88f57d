"""Token ids -> text as they come: incremental detokenizing and exact stop strings.

`Detokenizer` hands out text only once it is whole: a token that ends inside a multi-byte
character decodes to U+FFFD until the next token completes it. `StopStrings` holds back any
tail that could be the start of a stop string, so a stop string split across tokens is cut
exactly, and nothing of it (nor anything after it) reaches the client.
"""
from __future__ import annotations


class Detokenizer:
    def __init__(self, tokenizer, prompt_tail: list[int] = ()):
        self.tok = tokenizer
        # start from a few prompt tokens: a byte-level tokenizer decodes a lone token's
        # leading space differently than in context
        self.ids = list(prompt_tail)
        self.prefix = 0
        self.read = len(self.ids)

    def add(self, token: int) -> str:
        self.ids.append(token)
        before = self.tok.decode(self.ids[self.prefix:self.read], skip_special_tokens=False)
        now = self.tok.decode(self.ids[self.prefix:], skip_special_tokens=False)
        if len(now) <= len(before) or now.endswith("\ufffd"):
            return ""  # an unfinished character: wait for the next token
        self.prefix, self.read = self.read, len(self.ids)
        return now[len(before):]

    def flush(self) -> str:
        """At the end: what is still held back (an unfinished character decodes as U+FFFD)."""
        if self.read == len(self.ids):
            return ""
        before = self.tok.decode(self.ids[self.prefix:self.read], skip_special_tokens=False)
        now = self.tok.decode(self.ids[self.prefix:], skip_special_tokens=False)
        self.prefix = self.read = len(self.ids)
        return now[len(before):]


class StopStrings:
    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.pending = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """(text safe to send, whether a stop string was met: nothing after it is sent)."""
        self.pending += text
        hits = [(self.pending.find(s), s) for s in self.stops if s in self.pending]
        if hits:
            pos = min(hits)[0]
            out, self.pending = self.pending[:pos], ""
            return out, True
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.pending)), hold, -1):
                if self.pending.endswith(s[:k]):
                    hold = k
                    break
        cut = len(self.pending) - hold
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out
