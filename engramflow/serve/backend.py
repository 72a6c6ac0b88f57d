"""What a server replica holds: one runner (a Pipeline, or the in-process Engine), the
checkpoint's tokenizer, and the scheduler that batches every request onto the runner."""
from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

from engramflow.chat import tokens as T
from engramflow.errors import EngramflowError
from engramflow.io.parsed_files import parsed
from engramflow.io.token_map import load_tokenizer
from engramflow.io.tokenizer_file import checkpoint_tokenizer_path
from engramflow.serve import protocol
from engramflow.serve.errors import ApiError, bad
from engramflow.serve.images import chat_images, image_token_id
from engramflow.serve.config import ServeConfig
from engramflow.serve.limits import check_counts, check_text_fits, max_token_chars
from engramflow.serve.choices import Choices
from engramflow.serve.structured_outputs import StructuredOutputs
from engramflow.serve.prefix_budget import prefix_cache_bytes
from engramflow.serve.prepare_pool import PreparePool
from engramflow.serve.prompt_tokens import PromptTokenizer
from engramflow.serve.request_json import parse_body
from engramflow.scheduling import QueueFull, Scheduler

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
_CURRENT: dict = {}  # this process's backend (a Serve replica is one process)


def current_backend() -> "Backend":
    return _CURRENT["backend"]


def set_backend(backend: "Backend | None") -> "Backend | None":
    """Install (or with None, remove) this process's backend; returns the one it replaces."""
    old = _CURRENT.pop("backend", None)
    if backend is not None:
        _CURRENT["backend"] = backend
    return old


def launch_runner(cfg: ServeConfig, owner=None):
    """The replica's runner; `owner` (Pipeline.launch's hook) lets the keeper own the actors."""
    if cfg.in_process:
        from engramflow.pipeline.engine import Engine

        return Engine(cfg.engine)
    from engramflow.pipeline.pipeline import Pipeline

    return Pipeline.launch(cfg.pipeline, owner=owner)


@dataclasses.dataclass
class CheckpointText:
    """The checkpoint's tokenizer and what the API derives from it. Seconds to build for a
    129k-token vocabulary (the plain-text copy most of them), so a replica builds it in a
    thread while its pipeline is launched or adopted (deployment.py)."""
    tokenizer: object
    prompts: PromptTokenizer
    token_chars: int
    eos_ids: frozenset

    @classmethod
    def load(cls, checkpoint: str) -> "CheckpointText":
        """Built once per process for the same tokenizer file (io/parsed_files.py)."""
        return parsed(checkpoint_tokenizer_path(checkpoint), "checkpoint text", cls._build)

    @classmethod
    def _build(cls, path: Path) -> "CheckpointText":
        tok = load_tokenizer(path)
        spec = path.read_text(encoding="utf-8")  # spares writing it out again
        return cls(tok, PromptTokenizer(tok, spec), max_token_chars(tok), frozenset({tok.token_to_id(T.EOS)} - {None}))


class Backend:
    def __init__(self, runner, cfg: ServeConfig, metrics=None, text: CheckpointText | None = None):
        self.runner, self.cfg, self.metrics = runner, cfg, metrics
        text = text or CheckpointText.load(cfg.checkpoint)
        self.tokenizer, self.prompts, self.token_chars, self.eos_ids = (text.tokenizer, text.prompts,
                                                                        text.token_chars, text.eos_ids)
        self.pool = PreparePool(cfg.prepare_workers, cfg.prepare_queue)
        self.scheduler = Scheduler(runner, cfg.max_sessions, cfg.max_queue, metrics=metrics,
                                   prefix_cache_bytes=self._prefix_cache_bytes()).start()
        self.grammars = StructuredOutputs(self.tokenizer, runner.cfg.vocab_size)  # compiles on first use

    def _prefix_cache_bytes(self) -> int:
        mb = self.cfg.prefix_cache_mb  # checked by ServeConfig
        if mb == 0:
            return 0
        return prefix_cache_bytes(mb, self.runner.cached_token_bytes(), self.runner.cfg.max_seq_len)

    def close(self) -> None:
        self.pool.close()
        self.scheduler.stop()
        self.runner.shutdown()

    def encode(self, text: str) -> list[int]:
        """A raw /v1/completions prompt, as vLLM reads one: special tokens written in the text
        become their single ids (a client may send a prompt the chat encoder wrote); no BOS is
        added that the text does not have. Chat messages never come here (`chat_settings`)."""
        return self.tokenizer.encode_batch([text], add_special_tokens=False)[0].ids  # off the GIL

    async def prepare(self, raw: bytes, chat: bool) -> protocol.Settings:
        """A request body -> its settings, in the prepare pool (never on the event loop)."""
        return await self.pool.run(self._prepare, raw, chat)

    def _prepare(self, raw: bytes, chat: bool) -> protocol.Settings:
        body = parse_body(raw)
        return self.chat_settings(body) if chat else self.completion_settings(body)

    def chat_settings(self, body: dict) -> protocol.Settings:
        self._check_model(body)
        urls = protocol.chat_image_urls(body)
        check_counts(body, self.cfg.limits, len(urls))
        pieces, options = protocol.chat_pieces(body)
        check_text_fits(sum(len(p.text) for p in pieces), self.token_chars, self.runner.cfg.max_seq_len, "messages")
        if not urls:
            s = self._settings(body, self.prompts.ids(pieces), None)
        else:  # the settings see the prompt as the model reads it, every image as its span
            ids = self.prompts.ids(pieces, image_token_id(self.runner))
            images, expanded = chat_images(self.runner, ids, urls, self.cfg.allow_remote_images, self.cfg.limits)
            s = self._settings(body, expanded, None)
            s.request_ids, s.images = ids, images
        s.chat, s.thinking = True, options.thinking
        protocol.chat_logprobs(body, s)
        self.grammars.settle(body, s)
        return s

    def completion_settings(self, body: dict) -> protocol.Settings:
        self._check_model(body)
        prompt = protocol.completion_prompt(body)
        if isinstance(prompt, str):
            check_text_fits(len(prompt), self.token_chars, self.runner.cfg.max_seq_len, "prompt")
        ids = self.encode(prompt) if isinstance(prompt, str) else prompt
        s = self._settings(body, ids, COMPLETIONS_DEFAULT_MAX_TOKENS)
        protocol.completion_logprobs(body, s)
        self.grammars.settle(body, s)
        return s

    def _check_model(self, body: dict) -> None:
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise bad(f"model must be a string, got {type(model).__name__}", "model")
        if model is not None and model != self.cfg.model:
            raise ApiError(404, f"the model {model!r} does not exist; this server serves {self.cfg.model!r}",
                           "model", "model_not_found")

    def _settings(self, body: dict, ids: list[int], default_max: int | None) -> protocol.Settings:
        vocab = self.runner.cfg.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise bad(f"a prompt token id is outside [0, {vocab})", "prompt")
        try:
            return protocol.common(body, ids, self.runner.cfg.max_seq_len, vocab, default_max, self.cfg.max_n)
        except EngramflowError as e:  # a sampling value the runner refuses
            raise bad(str(e)) from None

    def start(self, s: protocol.Settings) -> Choices:
        self.check_health(503)
        choices = Choices(s, self.tokenizer, asyncio.get_running_loop(), self.metrics, self.eos_ids,
                          lambda: self.grammars.constraint(s))
        try:
            for request in choices.requests:
                self.scheduler.add(request)
        except QueueFull as e:
            choices.cancel()  # any added before the queue filled retire unseen
            raise ApiError(429, str(e), code="queue_full", headers={"Retry-After": "1"}) from None
        except EngramflowError as e:
            choices.cancel()
            raise ApiError(503, str(e)) from None
        return choices

    def health(self) -> dict:
        self.check_health(503)
        return {"status": "ok", **self.scheduler.stats(), "sessions": self._sessions()}

    def check_health(self, status: int = 500) -> None:
        """Once recovery has given up, this replica's pipeline is spent: refuse work (503, retry
        soon) and fail Ray Serve's health check, so that Serve replaces the replica with a new one
        (a new pipeline) and the server goes on serving."""
        if self.scheduler.gave_up is not None:
            raise ApiError(status, f"this replica's pipeline failed and is being replaced "
                                   f"({self.scheduler.gave_up}); retry shortly", code="replica_restarting",
                           headers={"Retry-After": "5"})

    def _sessions(self) -> int:
        """The runner's open sessions that serve requests: not those the prefix cache keeps
        (/health shows them as prefix_cache.entries). Read from the HTTP thread while the
        scheduler changes them."""
        prefix = self.scheduler.prefix
        for _ in range(100):
            try:
                return len(self.runner.sessions) - prefix.entries
            except RuntimeError:  # the dict changed size while it was listed: look again
                continue
        return -1
