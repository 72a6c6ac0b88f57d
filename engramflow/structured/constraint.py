"""One request's grammar state on the scheduler's side: the mask of its next token, and the
matcher advanced with each token the request is given.

With thinking on, the grammar applies to the answer, not the reasoning: the constraint waits,
masking nothing, until the request writes `</think>` (one token), as vLLM's reasoning parsers
do. A request is in at most one step in flight, so the mask for its next step is known when
the step is made: `pick(base)` attaches it (or hands `base` back when nothing is constrained
yet) and `advance(token)` follows the token that step picked. A speculative block is masked
on the driver instead (`mask_block`), where its target rows come back.
"""
from __future__ import annotations

import logging

from engramflow.structured.masked_pick import MaskedPick

log = logging.getLogger("engramflow.structured")


class Constraint:
    def __init__(self, compiled, vocab_size: int, think_end: int | None = None):
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(compiled)  # rollback unbounded: a verified block's drafts are undone
        self.vocab_size = vocab_size
        self.think_end = think_end  # None: constrained from the first token
        self.active = think_end is None
        self.broken = False  # a token the grammar refused was picked: stop constraining

    def pick(self, base):
        """The step's pick: `base` under this request's next-token mask."""
        if not self.active or self.broken or self.matcher.is_terminated():
            return base
        return MaskedPick(base, self.bitmask())

    def bitmask(self):
        import xgrammar as xgr

        words = xgr.allocate_token_bitmask(1, self.vocab_size)
        self.matcher.fill_next_token_bitmask(words)
        return words[0].numpy()

    def advance(self, token: int) -> None:
        if not self.active:
            self.active = token == self.think_end
            return
        if self.broken or self.matcher.is_terminated():
            return
        if not self.matcher.accept_token(token):
            # only a token picked without this mask gets here (a bug): say so and let it run free
            log.error("token %d is outside the request's grammar; it goes on unconstrained", token)
            self.broken = True

    def mask_block(self, rows, drafts: list[int]):
        """A speculative block's target rows [k+1, V], row j masked as it would be after drafts
        0..j-1: so the verdict never keeps a draft the grammar refuses, and the token it picks
        after the kept drafts is allowed. The drafts are followed on the matcher and undone
        (the scheduler advances it with the tokens the verdict emits). Rows past the first
        refused draft stay as they are: the verdict stops there."""
        from engramflow.structured.masked_pick import mask_logits

        rows = rows.float().clone()
        active, followed = self.active, 0
        for j in range(rows.shape[0]):
            if self.active and not self.broken and not self.matcher.is_terminated():
                rows[j] = mask_logits(rows[j], self.bitmask())
            if j == len(drafts):
                break
            if not self.active:
                self.active = drafts[j] == self.think_end
            elif self.broken or self.matcher.is_terminated() or not self.matcher.accept_token(drafts[j]):
                break
            else:
                followed += 1
        if followed:
            self.matcher.rollback(followed)
        self.active = active
        return rows

    @property
    def finished(self) -> bool:
        """The grammar is complete (and its stop token taken)."""
        return self.matcher.is_terminated()
