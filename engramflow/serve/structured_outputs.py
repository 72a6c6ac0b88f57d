"""A replica's structured outputs: each request's grammar checked and compiled while it is
prepared (a 400 naming the field, before anything is queued), and a fresh matcher for each of
its choices when it starts.

The compiler is made on the first constrained request (xgrammar reads the whole vocabulary
once, about a second), so a replica that never sees one never pays for it.
"""
from __future__ import annotations

import threading

from engramflow.chat import tokens as T
from engramflow.serve.errors import bad
from engramflow.serve.output_rules import output_grammar
from engramflow.structured.errors import GrammarError


class StructuredOutputs:
    def __init__(self, tokenizer, vocab_size: int):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.think_end = tokenizer.token_to_id(T.THINK_END)
        self._grammars = None
        self._lock = threading.Lock()

    def settle(self, body: dict, s) -> None:
        """Read the request's output rules into its settings; compile its grammar now."""
        spec, field = output_grammar(body, s.chat)
        if spec is None:
            return
        try:
            self.grammars.compile(spec)
        except GrammarError as e:
            raise bad(str(e), field) from None
        s.grammar = spec

    def constraint(self, s):
        """A new matcher for one choice of a prepared request (None: its output is free)."""
        if s.grammar is None:
            return None
        from engramflow.structured.constraint import Constraint

        think_end = self.think_end if s.chat and s.thinking else None  # the grammar starts after </think>
        return Constraint(self.grammars.compile(s.grammar), self.vocab_size, think_end)

    @property
    def grammars(self):
        with self._lock:
            if self._grammars is None:
                from engramflow.structured.grammars import Grammars

                self._grammars = Grammars(self.tokenizer, self.vocab_size)
            return self._grammars
