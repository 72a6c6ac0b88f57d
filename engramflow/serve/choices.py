"""A request's choices: one scheduler request for n = 1; for n > 1, one prefill and n forks.

n > 1 prefills the prompt but its last token once (a request that only writes, max_tokens 0),
then forks that session n times (an exact copy, runner.fork) and each fork writes the last
token itself, picking its first token from its own logits. Choice i draws every token from
sampling stream `first_stream + i` (Pick's stream), so it equals the n = 1 request with the
same seed and `sampling_stream: first_stream + i`: same prompt, same logits (a chunk's logits
do not depend on how the prompt was cut), same draws. Each choice has its own output (sink),
constraint and session; their events share one queue, tagged with the choice's index.
"""
from __future__ import annotations

import asyncio

from engramflow.model.sampling import Pick
from engramflow.scheduling import Request
from engramflow.serve.output import Output
from engramflow.serve.picking import pick_factory


class ForkSink:
    """The shared prefill's sink: it makes no tokens; an error or a cancel before the forks
    start ends every choice."""

    def __init__(self, outputs: list[Output]):
        self.outputs = outputs

    def on_token(self, picked) -> str | None:
        return "length"

    def on_finish(self, reason: str) -> None:
        if reason == "cancelled":  # "length": the prompt is written and the forks take over
            for out in self.outputs:
                out.on_finish(reason)

    def on_error(self, message: str) -> None:
        for out in self.outputs:
            out.on_error(message)


class Choices:
    def __init__(self, s, tokenizer, loop: asyncio.AbstractEventLoop, metrics, eos_ids: frozenset, constraint):
        """`constraint()` -> a new Constraint for one choice, or None (free output)."""
        self.queue: asyncio.Queue = asyncio.Queue()
        self.outputs = [Output(s, tokenizer, loop, metrics, i, self.queue) for i in range(s.n)]
        prompt = s.prompt_ids if s.request_ids is None else s.request_ids
        logprobs = (s.top_logprobs or 1) if s.logprobs else 0  # logprobs alone: the chosen token's own
        one = [Request(prompt if s.n == 1 else prompt[-1:], pick_factory(s.sampling, logprobs, s.top_p, s.logit_bias,
                                                                           s.first_stream + i),
                       out, eos_ids, max_tokens=s.max_tokens, constraint=constraint())
               for i, out in enumerate(self.outputs)]
        if s.n == 1:
            one[0].images = s.images
            self.request, self.forked = one[0], []
        elif len(prompt) == 1:  # nothing to share: n plain requests of the one token
            self.request, self.forked = None, one
        else:
            self.request = Request(prompt[:-1], lambda step: Pick(), ForkSink(self.outputs), eos_ids, images=s.images,
                                   max_tokens=0, forks=one)
            self.forked = one

    @property
    def requests(self) -> list[Request]:
        """What goes to the scheduler (forks start from the shared request)."""
        return [self.request] if self.request is not None else self.forked

    def cancel(self) -> None:
        for r in self.requests + self.forked:
            r.cancel()

    @property
    def cached_tokens(self) -> int | None:
        """Prompt tokens taken from the prefix cache (n > 1: by the shared prefill); None when
        no request was looked up (the server keeps no prefix cache)."""
        reqs = self.requests + self.forked
        if all(r.prefix_key is None for r in reqs):
            return None
        return max(r.cached_tokens for r in reqs)

    @property
    def completion_tokens(self) -> int:
        return sum(len(out.tokens) for out in self.outputs)
