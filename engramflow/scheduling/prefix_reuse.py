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
from engramflow.pipeline.image_inputs import prepare_images
from engramflow.pipeline.token_cost import token_bytes
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


class PrefixReuse:
    def __init__(self, runner, budget_bytes: int):
        self.runner = runner
        self.stage_token_bytes = runner.cached_token_bytes()
        self.cache = PrefixCache(budget_bytes, max(1, token_bytes(self.stage_token_bytes)), self._close)

    def plan(self, req) -> Reuse | None:
        """Look the request's prompt up (and remember its key for `keep`); None: prefill it all."""
        if req.image_spans or not req.prompt_ids:
            return None
        vision = getattr(self.runner, "vision_cfg", None)
        if req.images:  # prepared once here, so the key hashes exactly the pixels the runner writes
            req.images = prepare_images(req.images, vision)
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

    def open(self, reuse: Reuse) -> str:
        """A new session: the cached one's first `reuse.length` positions (fork, then roll back)."""
        session = self.runner.fork(reuse.source)
        self.runner.rollback(session, reuse.length)
        return session

    def keep(self, req) -> bool:
        """Hand a retired request's session to the cache; False: the caller closes it."""
        if req.prefix_key is None or req.keep_session or req.session is None or req.session not in self.runner.sessions:
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

    def stats(self) -> dict:
        return self.cache.stats() | {"stage_token_bytes": self.stage_token_bytes}

    def _close(self, session: str) -> None:
        if session in self.runner.sessions:
            try:
                self.runner.close(session)
            except EngramflowError as e:  # the log drops it anyway; recovery reconciles the actors
                log.warning("closing cached %s: %s", session, e)
