"""GPU check (run when a device is lent; a few minutes at most).

Builds the tiny checkpoint, runs a 1- and 2-stage Ray pipeline whose stage actors hold their
blocks and KV caches on the GPU (projected K/V uploaded through pinned buffers, prefill gating
on the GPU), compares tokens and logits with the CPU Engine, and times prefill and decode.
Exits non-zero on any mismatch. Without CUDA it says so and exits 0.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from engramflow.model.synth import make_checkpoint
from engramflow.pipeline.engine import Engine
from engramflow.pipeline.pipeline import Pipeline

PROMPT = "Engram memory lets a model look things up " * 8


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 0
    ckpt = Path(sys.argv[1] if len(sys.argv) > 1 else "checkpoints/tiny")
    if not (ckpt / "config.json").is_file():
        make_checkpoint("tiny", ckpt, progress=False)
    engine = Engine(ckpt)
    ids = engine.encode(PROMPT)
    s = engine.open()
    ref_logits = engine.prefill(s, ids)
    (ref,) = engine.generate([ids], max_new_tokens=16)
    report, ok = {"device": torch.cuda.get_device_name(0)}, True
    for stages in (1, 2):
        pipe = Pipeline.launch(ckpt, stages=stages)
        try:
            where = pipe.where()
            assert all(st["device"].startswith("cuda") for st in where["stages"]), where
            p = pipe.open()
            t = time.perf_counter()
            logits = pipe.prefill(p, ids)
            prefill_ms = (time.perf_counter() - t) * 1e3
            t = time.perf_counter()
            (g,) = pipe.generate([ids], max_new_tokens=16)
            decode_tps = 16 / (time.perf_counter() - t)
        finally:
            pipe.shutdown()
        diff = float((logits - ref_logits).abs().max())
        same = g.tokens == ref.tokens
        ok &= same and diff < 1e-3
        report[f"{stages}_stages"] = {"max_logit_diff": diff, "same_tokens": same, "prefill_ms": prefill_ms,
                                      "decode_tokens_per_s": decode_tps, "exposed_wait_ms": g.exposed_wait_ms}
    print(json.dumps(report, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
