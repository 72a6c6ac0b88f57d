"""The scheduler's side of prefix reuse: which cached session a new request forks, and which
retired sessions the cache keeps.

On admit, a request's prompt key (prefix_key.py) is looked up; with a shared prefix of L
positions (at most the prompt's length - 1, so that the last token is prefilled and the first
token picked as always) the cached session is forked, the fork rolled back to L, and only the
rest of the prompt is prefilled, at start_pos L. Fork and rollback are exact on every component
(every stage's caches, the history's n-gram state, the DSpark rings), and in the default
"batched" numerics a session's bits do not depend on how its prompt was cut into chunks, so the
request's tokens and logprobs are those of the same request cold. (In "official" numerics the
rest of the prompt is prefilled in other chunks than cold, and the tokens may differ as they may
between two chunk sizes.)

On retire, the request's session is handed to the cache instead of being closed, keyed by its
prompt key followed by the tokens it wrote after the prompt (the runner's log is the truth:
the key is cut to the log's length, and a session whose log disagrees with the key is closed,
never kept). Not cached: a session its caller keeps (keep_session), a prompt with dead
positions but no images (image_spans: the key cannot say which positions were dead), and the
choices of n > 1 (they continue a fork; their shared prompt is cached through its prefill).
"""
from __future__ import annotations

import dataclasses
import logging

import numpy as np

from engramflow.errors import EngramflowError
from engramflow.model.token_cost import token_bytes
from engramflow.model.vision import prepare_any
from engramflow.scheduling.prefix_cache import PrefixCache
from engramflow.scheduling.prefix_key import prompt_key

log = logging.getLogger("engramflow.scheduler")


@dataclasses.dataclass
class Reuse:
    """A request's prefix found in the cache: fork `source`, keep `length` positions, prefill the rest."""
    source: str
    length: int
    ids: list
    images: list | None


DEFAULT_CONTEXTS = 8  # the default budget: room for this many full contexts ...
DEFAULT_CAP_BYTES_PER_STAGE = 1 << 30  # ... but never more than 1 GiB on any one stage


def default_budget_bytes(stage_token_bytes: list[int], max_seq_len: int) -> int:
    """The budget when none is given: DEFAULT_CONTEXTS full contexts, capped so that the stage a
    position costs most holds at most DEFAULT_CAP_BYTES_PER_STAGE of cached sessions."""
    worst = max(stage_token_bytes, default=0)
    positions = DEFAULT_CONTEXTS * max_seq_len
    if worst:
        positions = min(positions, DEFAULT_CAP_BYTES_PER_STAGE // worst)
    return positions * token_bytes(stage_token_bytes)


class PrefixReuse:
    """With a budget of 0 bytes it is off: nothing is looked up or kept."""

    def __init__(self, runner, budget_bytes: int):
        self.runner = runner
        self.stage_token_bytes = runner.cached_token_bytes() if budget_bytes else []
        self.cache = (PrefixCache(budget_bytes, max(1, token_bytes(self.stage_token_bytes)), self._close)
                      if budget_bytes else None)

    @property
    def entries(self) -> int:
        return 0 if self.cache is None else len(self.cache)

    def plan(self, req) -> Reuse | None:
        """Look the request's prompt up (and remember its key for `keep`); None: prefill it all."""
        if self.cache is None or req.image_spans or len(req.prompt_ids) == 0:
            return None
        vision = self.runner.vision_cfg
        if req.images:
            if vision is None or not vision.enabled or not isinstance(req.images, (list, tuple)):
                return None  # the runner refuses them, with its own message
            # prepared once here (the runner takes prepared images as they are), so the key
            # hashes exactly the pixels the runner writes; a bad image raises ImageError here
            req.images = [prepare_any(img, vision, f"#{i + 1}") for i, img in enumerate(req.images)]
        pk = prompt_key(req.prompt_ids, req.images or [], None if vision is None else vision.image_token_id)
        req.prefix_key = pk.key
        found = self.cache.lookup(pk.key, pk.key.size - 1)
        if found is None:
            return None
        source, n = found
        n = pk.cut(n)
        if n < 1:
            return None
        cut, images_before = pk.split(n)
        self.cache.hit(n)
        req.cached_tokens = n
        return Reuse(source, n, req.prompt_ids[cut:], None if req.images is None else req.images[images_before:])

    @staticmethod
    def rest(req, reuse: Reuse | None) -> dict:
        """What is left to prefill (prefill_requests' ids, start_pos, images)."""
        if reuse is None:
            return {"ids": req.prompt_ids, "start_pos": None, "images": req.images}
        return {"ids": reuse.ids, "start_pos": reuse.length, "images": reuse.images}

    def open(self, reuse: Reuse) -> str:
        """A new session: the cached one's first `reuse.length` positions (fork, then roll back)."""
        session = self.runner.fork(reuse.source)
        self.runner.rollback(session, reuse.length)
        return session

    def keep(self, req) -> bool:
        """Hand a retired request's session to the cache; False: the caller closes it."""
        if self.cache is None or req.prefix_key is None or req.keep_session or req.session is None or req.session not in self.runner.sessions:
            return False
        tokens = np.asarray(self.runner.tokens(req.session), dtype=np.int64)
        prompt = req.prefix_key[:tokens.size]
        key = np.concatenate([prompt, tokens[prompt.size:]])
        text = key >= 0
        if not np.array_equal(key[text], tokens[text]):  # the log is the truth: never keep a state its key misstates
            log.warning("session %s: its log disagrees with its prompt key; not cached", req.session)
            return False
        self.cache.insert(req.session, key)
        return True

    def clear(self) -> None:
        """Close every cached session (the caller is done with the runner's sessions)."""
        if self.cache is not None:
            self.cache.clear()

    def stats(self) -> dict:
        """{"prefix_cache": its figures}, or {} when off."""
        if self.cache is None:
            return {}
        return {"prefix_cache": self.cache.stats() | {"stage_token_bytes": self.stage_token_bytes}}

    def _close(self, session: str) -> None:
        if session in self.runner.sessions:
            try:
                self.runner.close(session)
            except EngramflowError as e:  # the log drops it anyway; recovery reconciles the actors
                log.warning("closing cached %s: %s", session, e)
