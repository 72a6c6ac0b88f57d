"""The OpenAI server under load (`engramflow serve`, Ray Serve): throughput, TTFT and ITL in
vLLM's serving-benchmark names, at fixed concurrency levels and Poisson arrival rates.

Checks (ratios within one run, so they hold on a busy machine too):
  * throughput: emulated backbone (blocks sleep like a GPU's: what is measured is our
    orchestration), 4 stages, 16 concurrent streams: the server's output tokens/s over the same
    pipeline's in-process `generate` of the same 16 prompts with the same groups in flight
    (target >= 0.85); each side runs several rounds and the ratio is of their medians (single
    runs on the shared VM differ by 10-20 %);
  * chunked prefill: an 8K-token prompt arriving while 15 streams decode: p99 ITL of those
    streams over their median ITL (target <= 2.5);
  * hop floor: each per-step actor hop of a decode step (the profile's hop report) over a bare
    Ray actor round trip with the same payload (target <= 1.5), the round trip timed back to
    back and after the idle time that precedes a hop (serve_hops.py says why both);
  * the same load on v41-small (real V4.1 numerics, small), printed, and its output tok/s at 16
    concurrent streams over 1 stream: what one forward per step buys (target >= 5);
  * structured outputs on v41-small: output tok/s at 16 streams with every request under a JSON
    schema over the same 16 requests free (target >= 0.9): what the grammar costs (the scheduler
    fills each request's token mask, the last stage applies it). The schema's one string must be
    long, so the constrained requests run to max_tokens like the free ones and both rounds do
    the same work. `--only structured` runs this check alone.
The emulated run uses the tiny checkpoint with its runtime max_seq_len raised to fit the 8K
prompt (the emulated block time does not depend on the sequence length).
"""
from __future__ import annotations

import asyncio
import statistics
import json
import os
import time
from pathlib import Path

from common import parser, print_table, write_json
from serve_hops import hop_floor
from serve_load import run_load, summarize
from serve_process import Server

from engramflow.model.sampling import Sampling
from engramflow.model.synth import make_checkpoint

BLOCK_MS = 2.0


def checkpoint(path: Path, preset: str, max_seq_len: int | None = None) -> Path:
    if not (path / "config.json").is_file():
        make_checkpoint(preset, path, progress=False)
    if max_seq_len:
        cfg = json.loads((path / "config.json").read_text())
        if cfg.get("max_seq_len") != max_seq_len:
            (path / "config.json").write_text(json.dumps(cfg | {"max_seq_len": max_seq_len}, indent=1))
    return path


def prompts(n: int, length: int = 24) -> list[list[int]]:
    return [[1000 + 37 * k + i for i in range(length)] for k in range(n)]


def in_process(ckpt: Path, stages: int, backbone: str, bodies: list[dict], new_tokens: int, hops: bool,
               rounds: int) -> dict:
    """The same pipeline's own generate of the same prompts (groups in flight: one per stage),
    `rounds` times; the median round's tokens/s."""
    import ray
    from engramflow.pipeline.pipeline import Pipeline

    pipe = Pipeline.launch(ckpt, stages=stages, backbone=backbone, block_ms=BLOCK_MS)
    try:
        pipe.generate([b["prompt"] for b in bodies[:2]], max_new_tokens=2)  # warm-up
        per_round = []
        for _ in range(rounds):
            t = time.perf_counter()
            gens = pipe.generate([b["prompt"] for b in bodies], max_new_tokens=new_tokens, sampling=Sampling())
            per_round.append(sum(len(g.tokens) for g in gens) / (time.perf_counter() - t))
    finally:
        pipe.shutdown()
    try:  # its own pipeline, alone: a second one's idle actors would share the 2 cores with it
        floor = hop_floor(ckpt, stages, BLOCK_MS, 8.0) if hops else None
    finally:
        ray.shutdown()
    return {"output_throughput": statistics.median(per_round), "rounds": per_round, "hops": floor}


def start_server(ckpt: Path, stages: int, backbone: str, port: int) -> Server:
    return Server(ckpt, stages, port, ["--backbone", backbone, "--block-ms", str(BLOCK_MS), "--prefill-chunk", "512",
                                       "--max-sessions", "64"])


def bodies_for(n: int, new_tokens: int, length: int = 24) -> list[dict]:
    return [{"prompt": p, "max_tokens": new_tokens, "temperature": 0} for p in prompts(n, length)]


def load_rows(url: str, new_tokens: int, levels: list[int], rates: list[float], n: int, backbone: str) -> list[dict]:
    asyncio.run(run_load(url, bodies_for(2, 2)))  # warm-up
    rows = []
    for c in levels:
        rows.append(summarize(asyncio.run(run_load(url, bodies_for(n, new_tokens), concurrency=c)))
                    | {"concurrency": c, "request_rate": None, "backbone": backbone})
    for r in rates:
        rows.append(summarize(asyncio.run(run_load(url, bodies_for(n, new_tokens), rate=r)))
                    | {"concurrency": None, "request_rate": r, "backbone": backbone})
    return rows


def chunked_prefill(url: str, new_tokens: int, long_len: int) -> dict:
    """15 streams decode; an 8K-token prompt arrives after a quarter of their tokens."""
    async def run():
        others = asyncio.create_task(run_load(url, bodies_for(15, new_tokens)))
        await asyncio.sleep(0)
        while True:  # wait until the streams are decoding
            await asyncio.sleep(0.05)
            if others.done() or time.perf_counter() > started + 2.0:
                break
        long_body = [{"prompt": [2000 + (i % 5000) for i in range(long_len)], "max_tokens": 4, "temperature": 0}]
        long = await run_load(url, long_body)
        return await others, long
    started = time.perf_counter()
    others, long = asyncio.run(run())
    s = summarize(others)
    return {"long_prompt_tokens": long_len, "others_median_itl_ms": s["median_itl_ms"], "others_p99_itl_ms":
            s["p99_itl_ms"], "p99_over_median_itl": s["p99_itl_ms"] / s["median_itl_ms"],
            "long_ttft_ms": (long[0]["stamps"][0] - long[0]["start"]) * 1e3 if long[0].get("stamps") else None}


STRUCTURED_SCHEMA = {"type": "object", "properties": {"text": {"type": "string", "minLength": 4000}},
                     "required": ["text"]}


def structured_cost(url: str, new_tokens: int, rounds: int) -> dict:
    """16 streams, free and under STRUCTURED_SCHEMA, rounds alternating; the medians' ratio."""
    free = bodies_for(16, new_tokens)
    schema = [b | {"structured_outputs": {"json": STRUCTURED_SCHEMA}} for b in free]
    asyncio.run(run_load(url, schema[:2]))  # warm-up: the grammar compiler starts on first use
    tps = {"free": [], "json_schema": []}
    for _ in range(rounds):
        for name, bodies in (("free", free), ("json_schema", schema)):
            tps[name].append(summarize(asyncio.run(run_load(url, bodies, concurrency=16)))["output_throughput"])
    ratio = statistics.median(tps["json_schema"]) / statistics.median(tps["free"])
    print(f"\nstructured outputs, 16 streams, medians of {rounds} rounds: JSON schema "
          f"{statistics.median(tps['json_schema']):.1f} tok/s vs free {statistics.median(tps['free']):.1f} tok/s = "
          f"{ratio:.2f}x (target >= 0.9); rounds: schema {', '.join(f'{x:.1f}' for x in tps['json_schema'])}, "
          f"free {', '.join(f'{x:.1f}' for x in tps['free'])}")
    return {"rounds": tps, "ratio": ratio, "new_tokens": new_tokens}


def structured_run(ckpt: Path, stages: int, port: int, quick: bool) -> dict:
    server = start_server(ckpt, stages, "v41", port)
    try:
        return structured_cost(server.url, 8 if quick else 24, 3)
    finally:
        server.stop()


def backbone_run(ckpt: Path, stages: int, backbone: str, port: int, quick: bool, long_len: int | None) -> dict:
    """The checks on one backbone: in-process generate vs the server on the same 16 prompts,
    the load rows, and (given `long_len`) the chunked-prefill ITL."""
    new_tokens, n = (16, 16) if quick else (64, 32)
    if backbone == "v41":  # real numerics on CPU: fewer, shorter streams
        new_tokens, n = (8, 8) if quick else (24, 16)
    sixteen = bodies_for(16, new_tokens)
    rounds = 3 if quick or backbone != "emulated" else 5  # odd: the median is one of the runs
    base = in_process(ckpt, stages, backbone, sixteen, new_tokens, backbone == "emulated", rounds)
    server = start_server(ckpt, stages, backbone, port)
    try:
        levels = ([1, 16] if backbone == "v41" else [16]) if quick else [1, 4, 16, 32]
        rates = [4.0] if quick else [2.0, 8.0]
        rows = load_rows(server.url, new_tokens, levels, rates if backbone == "emulated" else [], n, backbone)
        runs = sorted((summarize(asyncio.run(run_load(server.url, sixteen, concurrency=16))) for _ in range(rounds)),
                      key=lambda r: r["output_throughput"])
        same16 = runs[len(runs) // 2] | {"rounds": [r["output_throughput"] for r in runs]}  # the median run
        chunk = chunked_prefill(server.url, 64 if quick else 160, long_len) if long_len else None
        structured = structured_cost(server.url, new_tokens, rounds) if backbone == "v41" else None
    finally:
        server.stop()
    ratio = same16["output_throughput"] / base["output_throughput"]
    # 16 streams: the median of the rounds of 16 requests at concurrency 16 (a load row may hold
    # fewer requests than its concurrency); 1 stream: the concurrency-1 row
    one = next((r["output_throughput"] for r in rows if r["concurrency"] == 1), None)
    scaling = same16["output_throughput"] / one if one else None
    if scaling is not None:
        print(f"\n{backbone}: output tok/s at 16 streams {same16['output_throughput']:.1f} / at 1 stream {one:.1f} = "
              f"{scaling:.2f}x" + (" (target >= 5)" if backbone == "v41" else ""))
    print(f"\n{backbone}, {stages} stages, 16 streams, medians of {rounds} rounds: server "
          f"{same16['output_throughput']:.1f} tok/s vs in-process generate {base['output_throughput']:.1f} tok/s = "
          f"{ratio:.2f}x (target >= 0.85); rounds: server {', '.join(f'{x:.1f}' for x in same16['rounds'])}, "
          f"in-process {', '.join(f'{x:.1f}' for x in base['rounds'])}")
    if chunk:
        print(f"chunked prefill: an {chunk['long_prompt_tokens']}-token prompt mid-run: others' p99 ITL "
              f"{chunk['others_p99_itl_ms']:.1f} ms / median {chunk['others_median_itl_ms']:.1f} ms = "
              f"{chunk['p99_over_median_itl']:.2f}x (target <= 2.5)")
    h = base.get("hops")
    if h:
        print(f"hop floor: worst decode hop {h['worst_hop_ms']:.2f} ms / bare actor round trip after "
              f"{h['idle_gap_ms']:.0f} ms idle (as every hop follows) {h['bare_after_idle_ms']:.2f} ms = "
              f"{h['worst_hop_over_bare_after_idle']:.2f}x (target <= 1.5); / back-to-back round trip "
              f"{h['bare_round_trip_ms']:.2f} ms = {h['worst_hop_over_bare']:.2f}x; hops: "
              + ", ".join(f"{k} {v:.2f}" for k, v in h["hop_median_ms"].items()))
        print("bare round trip after an idle gap: " + ", ".join(
            f"{gap} ms idle -> {ms:.2f} ms" for gap, ms in h["bare_round_trip_by_idle_ms"].items()))
    return {"rows": rows, "throughput_check": {"server": same16, "in_process": base, "ratio": ratio},
            "streams_16_over_1": scaling,
            "chunked_prefill": chunk, "hop_floor": h, "stages": stages, "structured_outputs": structured}


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--port", type=int, default=8011)
    p.add_argument("--workdir", default="checkpoints", help="checkpoints are made here when missing")
    p.add_argument("--only", choices=["emulated", "v41", "structured", "multiturn"],
                   help="run one backbone's checks only, or the structured-outputs or multi-turn "
                        "(prefix cache, serve_multiturn.py) check alone")
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    work = Path(args.workdir)
    empty = {"rows": []}
    if args.only == "multiturn":
        from serve_multiturn import multiturn

        write_json(args.json, {"multiturn": multiturn(checkpoint(work / "v41-small", "v41-small"), 2, args.port)})
        return
    if args.only == "structured":
        write_json(args.json, {"structured_outputs": structured_run(checkpoint(work / "v41-small", "v41-small"), 2,
                                                                    args.port, args.quick), "quick": args.quick})
        return
    emulated = empty if args.only == "v41" else backbone_run(
        checkpoint(work / "tiny-serve", "tiny", max_seq_len=16384), 4, "emulated", args.port, args.quick, 8192)
    v41 = empty if args.only == "emulated" else backbone_run(
        checkpoint(work / "v41-small", "v41-small"), 2, "v41", args.port, args.quick, None)
    cols = ["backbone", "concurrency", "request_rate", "completed", "request_throughput", "output_throughput",
            "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_itl_ms", "median_itl_ms", "p99_itl_ms"]
    print()
    print_table(emulated["rows"] + v41["rows"], cols)
    write_json(args.json, {"emulated": emulated, "v41": v41, "quick": args.quick, "block_ms": BLOCK_MS})


if __name__ == "__main__":
    main()
