"""generate(): the prompts as groups of sessions, each group one lane with one step in flight.

A group prefills its members' prompts (one chunk per step, so each prompt's numerics equal a
plain `prefill`), then decodes its members in lockstep. Read `group_steps` top to bottom:
each `yield` hands a step to StepsInFlight (in_flight.py), which submits it and sends back
its result when it is collected. A member's tokens are drawn by `Pick`s keyed by (its
stream, the token's index), on the last stage: the same tokens whatever the grouping or the
depth.
"""
from __future__ import annotations

import dataclasses
import time

import numpy as np

from engramflow.errors import EngramflowError
from engramflow.io.token_map import as_token_ids
from engramflow.memory.image_spans import spans_to_mask
from engramflow.model.sampling import Pick, Sampling
from engramflow.pipeline import speculative
from engramflow.pipeline.image_inputs import expand, prepare_images, text_with_images
from engramflow.pipeline.in_flight import Lane, StepsInFlight, check_in_flight
from engramflow.validate import check_int


@dataclasses.dataclass
class Generation:
    session: str
    prompt_ids: list[int]
    tokens: list[int]
    text: str
    seconds: float
    exposed_wait_ms: dict[int, float]

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / self.seconds if self.seconds > 0 else 0.0


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


def _prompt_ids(prompt, encode) -> list:
    if isinstance(prompt, str):
        return encode(prompt)
    if isinstance(prompt, (list, tuple, np.ndarray)):
        return list(prompt)
    raise EngramflowError(f"a prompt must be text or a list of token ids, got {type(prompt).__name__}")


def generate(runner, prompts: list, max_new_tokens: int, sampling: Sampling | None, image_spans: list | None,
             keep_sessions: bool, in_flight: int | None, images: list | None = None) -> list[Generation]:
    """Runner.generate (see there): every prompt checked before any session opens; one lane
    per group of sessions, all in flight together."""
    sampling = sampling or Sampling()
    check_int("max_new_tokens", max_new_tokens, 0)
    depth = check_in_flight(runner.in_flight_default if in_flight is None else in_flight)
    if not prompts:
        raise EngramflowError("no prompts given")
    images = [None] * len(prompts) if images is None else images
    prompt_ids = [_prompt_ids(p, runner.encode) if imgs is None or not isinstance(p, str)
                  else text_with_images(p, runner.encode, runner.vision_cfg) for p, imgs in zip(prompts, images)]
    spans = image_spans or [None] * len(prompts)
    if len(spans) != len(prompts) or len(images) != len(prompts):
        raise EngramflowError(f"{len(spans)} image span lists / {len(images)} image lists for {len(prompts)} prompts")
    prepared = []
    for ids, sp, imgs in zip(prompt_ids, spans, images):  # validate every prompt before opening anything
        arr = as_token_ids(ids, runner.cfg.vocab_size)
        if arr.size == 0:
            raise EngramflowError("empty prompt")
        prepared.append(None if imgs is None else prepare_images(imgs, runner.vision_cfg))
        if imgs is not None:
            if sp:
                raise EngramflowError("pass images (their spans follow) or image_spans, not both")
            arr = expand(arr, prepared[-1], runner.vision_cfg, runner.cfg.max_seq_len, 0)[0]
        if arr.size + max_new_tokens > runner.cfg.max_seq_len:
            raise EngramflowError(
                f"prompt of {arr.size} tokens + {max_new_tokens} new exceeds max_seq_len={runner.cfg.max_seq_len}")
        if sp:
            spans_to_mask(sp, arr.size)
    members: list[Member] = []
    t0 = time.perf_counter()
    waits: dict[int, list[float]] = {}
    with runner.deferred_session_ops():
        try:
            for i, (ids, sp, imgs) in enumerate(zip(prompt_ids, spans, prepared)):
                members.append(Member(i, runner.open(), ids, sp, images=imgs))
            StepsInFlight(runner, depth).run(_lanes(runner, members, depth, max_new_tokens, sampling, waits))
        finally:
            if not keep_sessions:
                for m in members:
                    try:
                        runner.close(m.session)
                    except EngramflowError:  # do not hide the error that got us here
                        pass
    seconds = time.perf_counter() - t0
    mean_waits = {layer: float(np.mean(v)) for layer, v in waits.items()}
    return [Generation(m.session, list(map(int, m.prompt_ids)), m.tokens, runner.decode(m.tokens), seconds,
                       mean_waits) for m in members]


def _lanes(runner, members: list[Member], depth: int, max_new_tokens: int, sampling: Sampling,
           waits: dict[int, list[float]]) -> list[Lane]:
    """Plain decoding: `depth` groups of sessions in lockstep. Speculative (the runner drafts):
    one lane per session, each step a drafted block verified (speculative.py)."""
    if runner.speculative is None:
        return [group_steps(runner, g, max_new_tokens, sampling, waits) for g in split_groups(members, depth)]
    runner.speculative_stats = stats = speculative.SpeculativeStats()
    return [speculative.session_lane(runner, m, max_new_tokens, sampling, stats) for m in members]


def group_steps(runner, members: list[Member], max_new_tokens: int, sampling: Sampling,
                decode_waits: dict[int, list[float]]) -> Lane:
    """One group's steps: every prompt's chunks, then lockstep decode until each member has
    `max_new_tokens` tokens. `decode_waits` (layer -> every decode step's exposed wait) is
    shared by all groups."""
    def pick(m: Member) -> Pick:
        return Pick(sampling, m.stream, len(m.tokens))

    for m in members:
        chunks = runner.prefill_requests(m.session, m.prompt_ids, image_spans=m.image_spans, pick=pick(m),
                                         images=m.images)
        for chunk in chunks:
            result = yield [chunk]
        if max_new_tokens:  # the prompt's last chunk picked its first token
            m.tokens.append(result.logits[0].token)
    while len(members[0].tokens) < max_new_tokens:  # every member wants the same count
        result = yield [runner.request(m.session, [m.tokens[-1]], pick=pick(m)) for m in members]
        for m, picked in zip(members, result.logits):
            m.tokens.append(picked.token)
        for layer, ms in result.exposed_wait_ms.items():
            decode_waits.setdefault(layer, []).append(ms)
