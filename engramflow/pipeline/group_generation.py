"""generate() as groups of sessions, each with one step in flight.

A group prefills its members' prompts (one chunk per step, so each prompt's numerics equal a
plain `prefill`), then decodes its members in lockstep. Every collected step submits the
group's next one at once. A member's tokens are drawn by `Pick`s keyed by (its stream, the
token's index), on the last stage: the same tokens whatever the grouping or the depth.
"""
from __future__ import annotations

import dataclasses
from collections import deque

from engramflow.model.sampling import Pick, Sampling
from engramflow.pipeline.in_flight import StepsInFlight
from engramflow.pipeline.step import StepResult


@dataclasses.dataclass
class Member:
    stream: int  # the prompt's index: its sampling stream
    session: str
    prompt_ids: list
    image_spans: list | None
    tokens: list = dataclasses.field(default_factory=list)
    images: list | None = None  # PreparedImages for the prompt's image placeholders


def split_groups(members: list[Member], groups: int) -> list[list[Member]]:
    """Round-robin into at most `groups` non-empty groups (sizes differ by at most one)."""
    return [g for g in (members[k::groups] for k in range(groups)) if g]


class GroupGeneration:
    def __init__(self, flight: StepsInFlight, members: list[Member], max_new_tokens: int, sampling: Sampling,
                 decode_waits: dict[int, list[float]]):
        self.flight, self.members = flight, members
        self.max_new_tokens, self.sampling = max_new_tokens, sampling
        self.decode_waits = decode_waits  # layer -> exposed wait of every decode step (shared)
        self._prefill = deque(members)
        self._chunks: deque = deque()

    @property
    def runner(self):
        return self.flight.runner

    def start(self) -> None:
        self._next_prefill_chunk()

    def _pick(self, m: Member) -> Pick:
        return Pick(self.sampling, m.stream, len(m.tokens))

    def _next_prefill_chunk(self) -> None:
        if not self._chunks:
            if not self._prefill:
                return self._decode()
            m = self._prefill.popleft()
            self._chunks.extend(self.runner.prefill_requests(m.session, m.prompt_ids, image_spans=m.image_spans,
                                                             pick=self._pick(m), images=m.images))
        self.flight.submit([self._chunks.popleft()], self._prefilled)

    def _prefilled(self, result: StepResult) -> None:
        if not self._chunks:  # a prompt's last chunk: its first token
            m = self.members[len(self.members) - len(self._prefill) - 1]
            if self.max_new_tokens:
                m.tokens.append(result.logits[0].token)
        self._next_prefill_chunk()

    def _decode(self) -> None:
        if any(len(m.tokens) >= self.max_new_tokens for m in self.members):
            return  # every member has all its tokens (they all want the same count)
        reqs = [self.runner.request(m.session, [m.tokens[-1]], pick=self._pick(m)) for m in self.members]
        self.flight.submit(reqs, self._decoded)

    def _decoded(self, result: StepResult) -> None:
        for m, picked in zip(self.members, result.logits):
            m.tokens.append(picked.token)
        for layer, ms in result.exposed_wait_ms.items():
            self.decode_waits.setdefault(layer, []).append(ms)
        self._decode()
