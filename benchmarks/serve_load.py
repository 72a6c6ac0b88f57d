"""The load generator of bench_serve.py: streams over aiohttp, at a fixed concurrency or with
Poisson arrivals, and vLLM's serving-benchmark statistics of what came back.

TTFT: request sent -> first streamed token chunk. ITL: the gaps between a stream's chunks.
"""
from __future__ import annotations

import asyncio
import json
import random
import time

import aiohttp
import numpy as np


async def sse_chunks(resp):
    """The JSON chunks of a server-sent event stream, up to `data: [DONE]`."""
    async for raw in resp.content:
        line = raw.decode().strip()
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[6:])


async def stream_one(session: aiohttp.ClientSession, url: str, body: dict, key: str | None = None) -> dict:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    t0 = time.perf_counter()
    stamps, tokens = [], 0
    async with session.post(url + "/v1/completions", json=body | {"stream": True,
                            "stream_options": {"include_usage": True}}, headers=headers) as resp:
        if resp.status != 200:
            return {"error": resp.status}
        async for chunk in sse_chunks(resp):
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                stamps.append(time.perf_counter())
    return {"start": t0, "stamps": stamps, "tokens": tokens, "end": time.perf_counter()}


async def run_load(url: str, bodies: list[dict], concurrency: int | None = None, rate: float | None = None,
                   seed: int = 0) -> list[dict]:
    """Every body once: at most `concurrency` streams open, or arrivals at `rate` per second."""
    rng = random.Random(seed)
    sem = asyncio.Semaphore(concurrency or len(bodies))
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout,
                                     connector=aiohttp.TCPConnector(limit=len(bodies) + 8)) as session:
        async def one(body, delay):
            await asyncio.sleep(delay)
            async with sem:
                return await stream_one(session, url, body)
        delays, t = [], 0.0
        for _ in bodies:
            delays.append(t)
            if rate:
                t += rng.expovariate(rate)
        return await asyncio.gather(*(one(b, d) for b, d in zip(bodies, delays)))


def summarize(results: list[dict]) -> dict:
    """vLLM's names: request and output throughput, TTFT and ITL in ms (mean, median, p99)."""
    ok = [r for r in results if "error" not in r and r["stamps"]]
    t0, t1 = min(r["start"] for r in ok), max(r["end"] for r in ok)
    ttft = [(r["stamps"][0] - r["start"]) * 1e3 for r in ok]
    itl = [(b - a) * 1e3 for r in ok for a, b in zip(r["stamps"], r["stamps"][1:])]
    out = {"completed": len(ok), "failed": len(results) - len(ok), "duration_s": t1 - t0,
           "total_output_tokens": sum(r["tokens"] for r in ok),
           "request_throughput": len(ok) / (t1 - t0), "output_throughput": sum(r["tokens"] for r in ok) / (t1 - t0)}
    for name, xs in (("ttft", ttft), ("itl", itl or [0.0])):
        out |= {f"mean_{name}_ms": float(np.mean(xs)), f"median_{name}_ms": float(np.median(xs)),
                f"p99_{name}_ms": float(np.percentile(xs, 99))}
    return out
