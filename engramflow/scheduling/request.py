"""One request to the scheduler, whoever makes it: a chat stream, a `generate` prompt, a
prefill-job row. It carries what the steps need (prompt ids, images, how each token is picked,
when to stop) and the scheduler's state for it (its session, prompt chunks left, tokens made,
speculation). Its output goes to a sink, called on the scheduler's thread."""
from __future__ import annotations

import collections
import dataclasses
from typing import Protocol

from engramflow.model.sampling import Picked


class Sink(Protocol):
    """Where a request's output goes; called on the scheduler's thread, so it must be quick."""

    def on_token(self, picked: Picked) -> str | None: ...  # a finish reason ("stop", "length") ends it
    def on_finish(self, reason: str) -> None: ...  # "stop", "length", "cancelled"
    def on_error(self, message: str) -> None: ...


@dataclasses.dataclass(eq=False)
class Request:
    prompt_ids: list[int]
    pick: object  # (step) -> a Pick-like callable for token `step` of this request
    sink: Sink
    eos_ids: frozenset = frozenset()
    images: list | None = None  # PreparedImages for the prompt's image placeholders
    image_spans: list | None = None  # or: positions of the prompt written as dead (no Engram rows)
    max_tokens: int | None = None  # the sink ends it there (0: prefill only); drafts stop short of it
    keep_session: bool = False  # leave its session open when it retires (the caller closes it)
    constraint: object = None  # a structured.Constraint: its mask goes with each step's pick, its matcher follows the tokens
    forks: list = dataclasses.field(default_factory=list)  # requests that continue its session once it is written (n > 1)
    cancelled: bool = False  # set from any thread: the client went away
    # the scheduler's state
    session: str | None = None
    chunks: collections.deque = dataclasses.field(default_factory=collections.deque)
    generated: int = 0
    last_token: int | None = None
    admitted_at: float = 0.0
    speculation: object = None  # a SessionSpeculation when the request drafts
    waits: dict = dataclasses.field(default_factory=dict)  # Engram layer -> exposed wait (ms) over its steps
    prefix_key: object = None  # its prompt's prefix-cache key (prefix_key.py), when the scheduler caches prefixes
    cached_tokens: int = 0  # prompt positions taken from a cached session instead of prefilled

    def cancel(self) -> None:
        self.cancelled = True

    def pick_at(self, step: int):
        """Token `step`'s pick, under the request's grammar mask when it has one."""
        pick = self.pick(step)
        return pick if self.constraint is None else self.constraint.pick(pick)


class Collect:
    """A sink that keeps a request's tokens (generate, prefill-job): it ends the request at
    `max_tokens` and remembers an error instead of raising on the scheduler's thread."""

    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens
        self.picked: list[Picked] = []
        self.reason: str | None = None
        self.error: str | None = None

    @property
    def tokens(self) -> list[int]:
        return [p.token for p in self.picked]

    def on_token(self, picked: Picked) -> str | None:
        self.picked.append(picked)
        return "length" if len(self.picked) >= self.max_tokens else None

    def on_finish(self, reason: str) -> None:
        self.reason = reason

    def on_error(self, message: str) -> None:
        self.error = message


def add_waits(total: dict[int, float], step: dict[int, float]) -> None:
    """Sum a step's exposed wait per Engram layer into `total`."""
    for layer, ms in step.items():
        total[layer] = total.get(layer, 0.0) + ms
