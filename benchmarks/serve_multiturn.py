"""Multi-turn chats against `engramflow serve` with and without the prefix cache (bench_serve.py
--only multiturn, or run alone): several conversations of TURNS turns behind one long shared
instruction, their arrivals interleaved (each conversation starts a little after the previous
one and sends its next turn as soon as its last answer is complete, as a chat client does).
Each turn's prompt is the previous prompt, the answer's tokens and a new user message, sent as
token ids to /v1/completions (exact lengths; the chat template's own prefix is docs/prefix_reuse.md's).

Reported per turn: TTFT (request sent -> first streamed token) with the cache off
(--prefix-cache-mb 0) and on (the default size), and the share of the prompt the cache served
(usage.prompt_tokens_details.cached_tokens). Target: at turn 5 of a ~1,500-token conversation,
>= 70 % of the prompt cached and the TTFT (the prefill) <= 0.4x the cache-off one.
"""
from __future__ import annotations

import asyncio
import statistics
import time
from pathlib import Path

import aiohttp
import numpy as np
from serve_load import sse_chunks
from serve_process import Server

INSTRUCTION = 1200  # tokens of the shared instruction (a system prompt)
USER = 50  # tokens per user message
ANSWER = 16  # tokens per answer (max_tokens)
TURNS = 5
CONVERSATIONS = 4
STAGGER_S = 0.7  # between conversation starts




async def _turn(session: aiohttp.ClientSession, url: str, prompt: list[int]) -> dict:
    body = {"prompt": prompt, "max_tokens": ANSWER, "temperature": 0, "logprobs": 1, "stream": True,
            "stream_options": {"include_usage": True}, "return_tokens_as_token_ids": True}
    t0, first, tokens, usage = time.perf_counter(), None, [], None
    async with session.post(url + "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for chunk in sse_chunks(resp):
            if chunk.get("usage"):
                usage = chunk["usage"]
            for c in chunk.get("choices") or []:
                got = (c.get("logprobs") or {}).get("tokens") or []
                if got and first is None:
                    first = time.perf_counter()
                tokens += [int(t.split(":")[1]) for t in got]
    return {"ttft_ms": (first - t0) * 1e3, "prompt_tokens": usage["prompt_tokens"], "answer": tokens,
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)}


async def conversations(url: str, seed: int = 0) -> list[list[dict]]:
    rng = np.random.default_rng(seed)
    instruction = rng.integers(300, 60000, INSTRUCTION).tolist()
    users = [[rng.integers(300, 60000, USER).tolist() for _ in range(TURNS)] for _ in range(CONVERSATIONS)]

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
        async def one(c: int) -> list[dict]:
            await asyncio.sleep(c * STAGGER_S)
            prompt, turns = list(instruction), []
            for t in range(TURNS):
                prompt += users[c][t]
                turns.append(await _turn(session, url, prompt))
                prompt += turns[-1]["answer"]
            return turns
        await _turn(session, url, rng.integers(300, 60000, 40).tolist())  # warm-up, shares nothing
        return await asyncio.gather(*(one(c) for c in range(CONVERSATIONS)))


def per_turn(runs: list[list[dict]]) -> list[dict]:
    out = []
    for t in range(TURNS):
        rows = [conv[t] for conv in runs]
        out.append({"turn": t + 1, "median_ttft_ms": statistics.median(r["ttft_ms"] for r in rows),
                    "prompt_tokens": statistics.median(r["prompt_tokens"] for r in rows),
                    "cached_share": sum(r["cached_tokens"] for r in rows) / sum(r["prompt_tokens"] for r in rows)})
    return out


def multiturn(ckpt: Path, stages: int, port: int) -> dict:
    result = {}
    for name, extra in (("on", []), ("off", ["--prefix-cache-mb", "0"])):
        server = Server(ckpt, stages, port, ["--backbone", "v41", *extra])
        try:
            result[name] = per_turn(asyncio.run(conversations(server.url)))
        finally:
            server.stop()
    print(f"\nmulti-turn: {CONVERSATIONS} conversations x {TURNS} turns, interleaved, {INSTRUCTION}-token shared "
          f"instruction, {USER}-token messages, {ANSWER}-token answers, v41-small, {stages} stages")
    print("turn  prompt  TTFT off (ms)  TTFT on (ms)  on/off  cached")
    for off, on in zip(result["off"], result["on"]):
        print(f"{on['turn']:>4}  {on['prompt_tokens']:>6.0f}  {off['median_ttft_ms']:>13.0f}  {on['median_ttft_ms']:>12.0f}"
              f"  {on['median_ttft_ms'] / off['median_ttft_ms']:>6.2f}  {on['cached_share']:>6.1%}")
    last_off, last_on = result["off"][-1], result["on"][-1]
    result["turn5"] = {"cached_share": last_on["cached_share"],
                       "ttft_on_over_off": last_on["median_ttft_ms"] / last_off["median_ttft_ms"]}
    print(f"turn {TURNS}: {last_on['cached_share']:.1%} of the prompt cached (target >= 70 %), TTFT "
          f"{result['turn5']['ttft_on_over_off']:.2f}x the cache-off one (target <= 0.4)")
    return result


if __name__ == "__main__":
    import os

    from bench_serve import checkpoint
    from common import parser, write_json

    p = parser(__doc__)
    p.add_argument("--port", type=int, default=8012)
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--workdir", default="checkpoints", help="checkpoints are made here when missing")
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    write_json(args.json, {"multiturn": multiturn(checkpoint(Path(args.workdir) / "v41-small", "v41-small"),
                                                  args.stages, args.port)})
