"""generate(): every prompt is one request to the scheduler (scheduling/), stepped until done.

The prompts are checked before any session opens. Prompt `i`'s token `j` is drawn by
`Pick(sampling, i, j)` on the last stage, so its tokens do not depend on the other prompts,
on how many steps are in flight, or on speculative decoding's grouping of steps.
"""
from __future__ import annotations

import dataclasses
import time

import numpy as np

from engramflow.errors import EngramflowError
from engramflow.io.token_map import as_token_ids
from engramflow.memory.image_spans import spans_to_mask
from engramflow.model.sampling import Pick, Sampling
from engramflow.pipeline.image_inputs import expand, prepare_images, text_with_images
from engramflow.pipeline.in_flight import check_in_flight
from engramflow.scheduling import Collect, Request, Scheduler
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


def _prompt_ids(prompt, encode) -> list:
    if isinstance(prompt, str):
        return encode(prompt)
    if isinstance(prompt, (list, tuple, np.ndarray)):
        return list(prompt)
    raise EngramflowError(f"a prompt must be text or a list of token ids, got {type(prompt).__name__}")


def generate(runner, prompts: list, max_new_tokens: int, sampling: Sampling | None, image_spans: list | None,
             keep_sessions: bool, in_flight: int | None, images: list | None = None) -> list[Generation]:
    """Runner.generate (see there): every prompt checked before any session opens, then one
    request per prompt to the scheduler, stepped until all are done."""
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
    prepared = [_checked(runner, ids, sp, imgs, max_new_tokens) for ids, sp, imgs in zip(prompt_ids, spans, images)]
    requests = [Request(list(ids), _picks(sampling, stream), Collect(max_new_tokens), images=imgs, image_spans=sp,
                        max_tokens=max_new_tokens, keep_session=True)
                for stream, (ids, sp, imgs) in enumerate(zip(prompt_ids, spans, prepared))]
    waits: dict[int, list[float]] = {}
    scheduler = Scheduler(runner, max_sessions=len(requests), depth=depth,
                          on_step=lambda result, work: _decode_waits(result, work, waits))
    runner.speculative_stats = scheduler.speculative_stats
    t0 = time.perf_counter()
    try:
        for r in requests:
            scheduler.add(r)
        scheduler.drain()
        failed = next((r.sink.error for r in requests if r.sink.error is not None), None)
        if failed is not None:
            raise EngramflowError(failed)
    finally:
        if not keep_sessions:
            _close_all(runner, requests)
    seconds = time.perf_counter() - t0
    mean_waits = {layer: float(np.mean(v)) for layer, v in waits.items()}
    return [Generation(r.session, list(map(int, r.prompt_ids)), r.sink.tokens, runner.decode(r.sink.tokens), seconds,
                       mean_waits) for r in requests]


def _checked(runner, ids, spans, imgs, max_new_tokens: int):
    """A prompt's checks (before any session opens): its PreparedImages, or None."""
    arr = as_token_ids(ids, runner.cfg.vocab_size)
    if arr.size == 0:
        raise EngramflowError("empty prompt")
    prepared = None if imgs is None else prepare_images(imgs, runner.vision_cfg)
    if imgs is not None:
        if spans:
            raise EngramflowError("pass images (their spans follow) or image_spans, not both")
        arr = expand(arr, prepared, runner.vision_cfg, runner.cfg.max_seq_len, 0)[0]
    if arr.size + max_new_tokens > runner.cfg.max_seq_len:
        raise EngramflowError(
            f"prompt of {arr.size} tokens + {max_new_tokens} new exceeds max_seq_len={runner.cfg.max_seq_len}")
    if spans:
        spans_to_mask(spans, arr.size)
    return prepared


def _picks(sampling: Sampling, stream: int):
    """Token `step` of prompt `stream` is drawn by Pick(sampling, stream, step): the same tokens
    whatever the company, the depth or the driver."""
    return lambda step: Pick(sampling, stream, step)


def _decode_waits(result, work, waits: dict[int, list[float]]) -> None:
    """Every decode step's exposed wait per Engram layer (a step of decodes only)."""
    if all(r.generated > 0 for r, _ in work):  # no prompt chunk in it (called before its tokens count)
        for layer, ms in result.exposed_wait_ms.items():
            waits.setdefault(layer, []).append(ms)


def _close_all(runner, requests: list[Request]) -> None:
    for r in requests:
        if r.session is not None and r.session in runner.sessions:
            try:
                runner.close(r.session)
            except EngramflowError:  # do not hide the error that got us here
                pass
