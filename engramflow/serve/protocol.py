"""Request bodies of /v1/chat/completions and /v1/completions -> checked generation settings.

Every field is checked here, before the request reaches the scheduler; a wrong one is a 400
naming it. Thinking follows vLLM's V4.1 convention: on by default with effort "high";
`chat_template_kwargs: {"thinking": false}` (or `enable_thinking`) or `reasoning_effort:
"none"` turns it off; `reasoning_effort` may be top-level or in `chat_template_kwargs`.
"""
from __future__ import annotations

import dataclasses
import math
import os
import re

from engramflow.chat import ChatOptions, encode_chat
from engramflow.chat.encoder import encode_chat_pieces
from engramflow.chat.messages import ChatError, image_urls
from engramflow.chat.pieces import Piece
from engramflow.errors import SEED_MAX
from engramflow.model.sampling import Sampling
from engramflow.serve.errors import bad

MAX_STOPS = 16
MAX_TOP_LOGPROBS = 20


@dataclasses.dataclass
class Settings:
    prompt_ids: list[int]
    max_tokens: int
    sampling: Sampling
    top_p: float = 1.0
    logit_bias: dict[int, float] = dataclasses.field(default_factory=dict)
    stop: list[str] = dataclasses.field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    thinking: bool | None = None  # chat only: parse reasoning first
    chat: bool = False
    images: list | None = None  # chat image parts, prepared (PreparedImages, in placeholder order)
    request_ids: list[int] | None = None  # with images: the ids before each placeholder becomes its span
    token_ids: bool = False  # logprobs name tokens "token_id:N" (vLLM's return_tokens_as_token_ids)
    n: int = 1  # choices: one prefill, then n forks of it
    first_stream: int = 0  # choice i draws from sampling stream first_stream + i (`sampling_stream`)
    grammar: object = None  # the GrammarSpec the output must match (serve/output_rules.py), or None


def _num(body: dict, name: str, lo: float, hi: float, default, integer: bool = False):
    v = body.get(name)
    if v is None:
        return default
    ok = isinstance(v, int) if integer else isinstance(v, (int, float))
    if isinstance(v, bool) or not ok or not (lo <= v <= hi) or (not integer and not math.isfinite(v)):
        kind, bounds = ("an integer", f"[{lo}, {hi}]") if integer else ("a number", f"[{lo:g}, {hi:g}]")
        raise bad(f"{name} must be {kind} in {bounds}, got {v!r}", name)
    return v


def _bool(body: dict, name: str, default: bool = False) -> bool:
    v = body.get(name, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(f"{name} must be a boolean, got {v!r}", name)
    return v


def _stops(body: dict) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops) or len(stops) > MAX_STOPS:
        raise bad(f"stop must be a string or a list of at most {MAX_STOPS} strings", "stop")
    return stops


def _logit_bias(body: dict, vocab: int) -> dict[int, float]:
    v = body.get("logit_bias")
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise bad("logit_bias must be an object of token id -> bias", "logit_bias")
    out = {}
    for k, b in v.items():
        # decimal digits only: Python's int() would also read "5_0" (50), " 5" or "٥"
        if not _TOKEN_ID.fullmatch(k):
            raise bad(f"logit_bias key {k!r} is not a token id (decimal digits)", "logit_bias")
        tid = int(k)
        if not 0 <= tid < vocab:
            raise bad(f"logit_bias token id {tid} is outside [0, {vocab})", "logit_bias")
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not -100 <= b <= 100:
            raise bad(f"logit_bias value for {k} must be a number in [-100, 100], got {b!r}", "logit_bias")
        out[tid] = float(b)
    return out


_TOKEN_ID = re.compile(r"[0-9]{1,10}")

# fields not served: refused (a 400 naming them) unless they hold their no-op value
UNSERVED = {"presence_penalty": 0, "frequency_penalty": 0, "repetition_penalty": 1, "best_of": 1, "echo": False,
            "suffix": None}


def common(body: dict, prompt_ids: list[int], max_seq_len: int, vocab: int, default_max: int | None,
           max_n: int = 16) -> Settings:
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise bad("user must be a string", "user")
    n = _num(body, "n", 1, max_n, 1, integer=True)
    first_stream = _num(body, "sampling_stream", 0, 2**32, 0, integer=True)
    for name, neutral in UNSERVED.items():
        if body.get(name) is not None and body[name] != neutral:
            raise bad(f"{name}={body[name]!r} is not served", name)
    room = max_seq_len - len(prompt_ids)
    if room < 1:
        raise bad(f"the prompt holds {len(prompt_ids)} tokens; this model's length is {max_seq_len}",
                  "messages" if "messages" in body else "prompt", "context_length_exceeded")
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _num(body, name, 1, 2**31, None, integer=True)
    if max_tokens is None:
        max_tokens = room if default_max is None else min(default_max, room)
    elif max_tokens > room:
        raise bad(f"{name}={max_tokens} + the prompt's {len(prompt_ids)} tokens exceed this model's length "
                  f"{max_seq_len}", name, "context_length_exceeded")
    top_k = _num(body, "top_k", -1, 2**31, 0, integer=True)
    seed = _num(body, "seed", -(2**63), 2**64 - 1, None, integer=True)
    seed = int.from_bytes(os.urandom(4), "little") if seed is None else seed % (SEED_MAX + 1)
    sampling = Sampling(float(_num(body, "temperature", 0, 100, 1.0)), max(top_k, 0), seed)
    opts, stream = body.get("stream_options"), _bool(body, "stream")
    if opts is not None and not isinstance(opts, dict):
        raise bad("stream_options must be an object", "stream_options")
    if opts is not None and not stream:  # as vLLM: the options of a stream that is not asked for
        raise bad("stream_options is only allowed with stream: true", "stream_options")
    return Settings(prompt_ids, max_tokens, sampling, float(_num(body, "top_p", 1e-9, 1, 1.0)),
                    _logit_bias(body, vocab), _stops(body), stream,
                    _bool(opts or {}, "include_usage"), token_ids=_bool(body, "return_tokens_as_token_ids"),
                    n=n, first_stream=first_stream)


def thinking_options(body: dict) -> ChatOptions:
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise bad("chat_template_kwargs must be an object", "chat_template_kwargs")
    thinking = kwargs.get("thinking", kwargs.get("enable_thinking", True))
    if not isinstance(thinking, bool):
        raise bad("chat_template_kwargs.thinking must be a boolean", "chat_template_kwargs")
    effort = body.get("reasoning_effort", kwargs.get("reasoning_effort"))
    if effort == "none":
        thinking, effort = False, None
    return ChatOptions(thinking=thinking, reasoning_effort=effort, tools=body.get("tools"))


def chat_prompt(body: dict) -> tuple[str, ChatOptions]:
    """The prompt text (as the official encoder writes it) and the options."""
    options = _chat_options(body)
    try:
        return encode_chat(body.get("messages"), options), options
    except ChatError as e:
        raise bad(str(e), e.param) from None


def chat_pieces(body: dict) -> tuple[list[Piece], ChatOptions]:
    """The prompt as pieces: the format's structure apart from the client's text."""
    options = _chat_options(body)
    try:
        return encode_chat_pieces(body.get("messages"), options), options
    except ChatError as e:
        raise bad(str(e), e.param) from None


def _chat_options(body: dict) -> ChatOptions:
    # response_format, structured_outputs and tool_choice are read by serve/output_rules.py
    options = thinking_options(body)
    return dataclasses.replace(options, tools=None) if body.get("tool_choice") == "none" else options


def chat_image_urls(body: dict) -> list[str]:
    try:
        return image_urls(body.get("messages"))
    except ChatError as e:
        raise bad(str(e), e.param) from None


def chat_logprobs(body: dict, settings: Settings) -> None:
    settings.logprobs = _bool(body, "logprobs")
    settings.top_logprobs = _num(body, "top_logprobs", 0, MAX_TOP_LOGPROBS, 0, integer=True)
    if settings.top_logprobs and not settings.logprobs:
        raise bad("top_logprobs needs logprobs: true", "top_logprobs")


def completion_logprobs(body: dict, settings: Settings) -> None:
    n = _num(body, "logprobs", 0, MAX_TOP_LOGPROBS, None, integer=True)
    settings.logprobs = n is not None
    settings.top_logprobs = n or 0


def completion_prompt(body: dict):
    """The prompt: text (special tokens in it are tokenized as such) or token ids."""
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]  # a batch of one
    if isinstance(p, str) and p:
        return p
    if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        return p
    raise bad("prompt must be a non-empty string or list of token ids (one prompt per request; n for several "
              "choices)", "prompt")
