"""Pipeline vs Engine on the tiny checkpoint: decode tokens/s (ratio = what Ray costs),
per-step Ray overhead, and the exposed Engram wait per layer, for 1 and 2 stages."""
from __future__ import annotations

import time
from pathlib import Path

from common import parser, print_table, write_json
from engramflow.model.synth import make_checkpoint
from engramflow.pipeline.engine import Engine
from engramflow.pipeline.pipeline import Pipeline

PROMPTS = ["Engram memory lets a model look things up", "The quick brown fox", "Ray actors overlap work",
           "Tables stay in host memory"]


def run(runner, new_tokens: int, batch: int) -> dict:
    runner.generate(PROMPTS[:1], max_new_tokens=2)  # warm up
    t = time.perf_counter()
    gens = runner.generate(PROMPTS[:batch], max_new_tokens=new_tokens)
    seconds = time.perf_counter() - t
    steps = new_tokens - 1
    return {"tokens_per_s": batch * new_tokens / seconds, "ms_per_step": seconds / max(1, steps) * 1e3,
            "wait_L1_ms": gens[0].exposed_wait_ms.get(1, 0.0), "wait_L14_ms": gens[0].exposed_wait_ms.get(14, 0.0)}


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--checkpoint", default="checkpoints/tiny", help="made here if missing")
    args = p.parse_args()
    ckpt = Path(args.checkpoint)
    if not (ckpt / "config.json").is_file():
        make_checkpoint("tiny", ckpt)
    new_tokens = 8 if args.quick else 32
    rows = []
    for batch in (1, 4):
        base = run(Engine(ckpt), new_tokens, batch) | {"runner": "Engine", "stages": 1, "sessions": batch}
        rows.append(base)
        for stages in (1, 2):
            pipe = Pipeline.launch(ckpt, stages=stages)
            try:
                r = run(pipe, new_tokens, batch)
            finally:
                pipe.shutdown()
            r |= {"runner": "Pipeline", "stages": stages, "sessions": batch,
                  "vs_engine": r["tokens_per_s"] / base["tokens_per_s"],
                  "ray_overhead_ms_per_step": r["ms_per_step"] - base["ms_per_step"]}
            rows.append(r)
    print_table(rows, ["runner", "stages", "sessions", "tokens_per_s", "ms_per_step", "vs_engine",
                       "ray_overhead_ms_per_step", "wait_L1_ms", "wait_L14_ms"])
    write_json(args.json, {"rows": rows})


if __name__ == "__main__":
    main()
