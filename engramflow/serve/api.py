"""The OpenAI-compatible HTTP API (FastAPI), over a `Backend` the hosting process provides.

  POST /v1/chat/completions   messages in the V4.1 chat format; reasoning and tool calls parsed
  POST /v1/completions        a prompt (text with special tokens, or token ids)
  GET  /v1/models             the served model
  GET  /health                liveness and load (no key needed)

Streams are Server-Sent Events ending in `data: [DONE]`; when the request's generation fails
(recovery gave up) the stream ends with an error event instead of a finish. A client that
goes away cancels its request: the scheduler retires it and closes its session.
"""
from __future__ import annotations

import asyncio
import hmac
import json
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from engramflow.chat.parser import Delta
from engramflow.serve import responses as R
from engramflow.serve.errors import ApiError, error_body
from engramflow.serve.request_json import too_large


def _check_key(request: Request, key: str | None) -> None:
    if key is None:
        return
    got = request.headers.get("authorization", "")
    token = got[7:] if got.lower().startswith("bearer ") else ""
    if not hmac.compare_digest(token.encode(), key.encode()):  # constant time
        raise ApiError(401, "invalid API key", code="invalid_api_key")


async def _read_body(request: Request, limit: int) -> bytes:
    """The raw body, refused (413) past `limit` bytes: by its Content-Length before reading,
    else as soon as the bytes read pass it. Parsing it is the prepare pool's work."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise too_large(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def make_api(get_backend: Callable[[], object]) -> FastAPI:
    app = FastAPI(title="engramflow", docs_url=None, redoc_url=None)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, e: Exception):  # a bug: still OpenAI's body, never a bare trace
        return JSONResponse(error_body(f"internal error: {type(e).__name__}", "internal_server_error"), status_code=500)

    @app.get("/health")
    async def health():
        return get_backend().health()

    @app.get("/v1/models")
    async def models(request: Request):
        b = get_backend()
        _check_key(request, b.cfg.api_key)
        return {"object": "list", "data": [{"id": b.cfg.model, "object": "model", "created": 0,
                                            "owned_by": "engramflow", "max_model_len": b.runner.cfg.max_seq_len}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await _generate(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _generate(request, chat=False)

    async def _generate(request: Request, chat: bool):
        b = get_backend()
        _check_key(request, b.cfg.api_key)
        s = await b.prepare(await _read_body(request, b.cfg.max_body_bytes), chat)
        choices = b.start(s)
        env = R.Envelope(chat, b.cfg.model)
        if s.stream:
            return StreamingResponse(_stream(choices, s, env), media_type="text/event-stream")
        try:
            return await _whole(choices, s, env)
        finally:
            choices.cancel()  # a no-op when it finished; frees the sessions when the client left

    return app


async def _whole(choices, s, env: R.Envelope):
    n = len(choices.outputs)
    totals, logprobs, reasons = [Delta() for _ in range(n)], [[] for _ in range(n)], [None] * n
    while None in reasons:
        ev = await choices.queue.get()
        if ev.kind == "error":
            raise ApiError(500, f"generation failed: {ev.message}", code="generation_failed")
        if ev.kind == "finish":
            reasons[ev.index] = ev.reason
        totals[ev.index].add(ev.delta)
        logprobs[ev.index] += ev.logprobs
    out = [_choice(i, totals[i], logprobs[i], reasons[i], s) for i in range(n)]
    return env.body(out, usage=R.usage(s, choices.completion_tokens, choices.cached_tokens))


def _choice(index: int, total: Delta, logprobs: list, reason: str, s) -> dict:
    choice = {"index": index, "finish_reason": R.finish_reason(reason, bool(total.tool_calls)), "logprobs": None}
    if s.chat:
        msg = {"role": "assistant", "content": total.content or (None if total.tool_calls else "")}
        if s.thinking:
            msg["reasoning_content"] = msg["reasoning"] = total.reasoning
        if total.tool_calls:
            msg["tool_calls"] = [{k: v for k, v in c.items() if k != "index"}
                                 for c in R.ToolCallIds().stream_deltas(total.tool_calls)]
        choice["message"] = msg
        if s.logprobs:
            choice["logprobs"] = R.chat_logprobs(logprobs, s.top_logprobs)
    else:
        choice["text"] = total.content
        if s.logprobs:
            choice["logprobs"] = R.completion_logprobs(logprobs, s.top_logprobs, 0)
    return choice


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _stream(choices, s, env: R.Envelope):
    """Each choice's chunks carry its index; they interleave as the choices' tokens come."""
    n = len(choices.outputs)
    ids, offsets, open_ = [R.ToolCallIds() for _ in range(n)], [0] * n, n
    try:
        if s.chat:
            for i in range(n):
                yield _sse(env.chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                       "finish_reason": None}]))
        while open_:
            ev = await choices.queue.get()
            i = ev.index
            if ev.kind == "error":
                yield _sse(error_body(f"generation failed: {ev.message}", "internal_server_error",
                                      code="generation_failed"))
                break
            if ev.kind == "finish":
                reason = R.finish_reason(ev.reason, choices.outputs[i].saw_tool_calls)
                choice = {"index": i, "logprobs": None, "finish_reason": reason}
                choice |= {"delta": {}} if s.chat else {"text": ""}
                yield _sse(env.chunk([choice]))
                open_ -= 1
                if not open_ and s.include_usage:
                    yield _sse(env.chunk([], usage=R.usage(s, choices.completion_tokens, choices.cached_tokens)))
                continue
            choice = {"index": i, "logprobs": None, "finish_reason": None}
            if s.chat:
                choice["delta"] = R.chat_delta(ev, ids[i])
                if s.logprobs and ev.logprobs:
                    choice["logprobs"] = R.chat_logprobs(ev.logprobs, s.top_logprobs)
            else:
                choice["text"] = ev.delta.content
                if s.logprobs and ev.logprobs:
                    choice["logprobs"] = R.completion_logprobs(ev.logprobs, s.top_logprobs, offsets[i])
                offsets[i] += len(ev.delta.content)
            # with include_usage, usage comes in its own last chunk ("usage": null before it)
            yield _sse(env.chunk([choice]) | ({"usage": None} if s.include_usage else {}))
        yield "data: [DONE]\n\n"
    finally:
        choices.cancel()  # frees the sessions when the client went away mid-stream; a no-op once finished
