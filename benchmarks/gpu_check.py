"""GPU check (run when a device is lent; a few minutes at most).

1. `reference` backbone, tiny checkpoint: a 1- and 2-stage Ray pipeline whose stage actors hold
   their blocks and KV caches on the GPU (projected K/V uploaded through pinned buffers, prefill
   gating on the GPU) against the CPU Engine: tokens and logits, prefill and decode times.
2. `v41` backbone, v41-small checkpoint: the V4.1 stage with its weights (FP8/FP4 values and
   scales, the block GEMM in fp32) and caches on CUDA against the same stage on CPU: CUDA-vs-CPU
   logit agreement per prefix (max relative difference, argmax agreement), and per-stage decode
   ms with 2 stages both on the GPU. GPU fp32 GEMMs sum in another order than the CPU's, and the
   model re-quantises every GEMM input, so agreement is to FP8 level, not bitwise.
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
    if "--dry-run" in sys.argv:  # the v41 part on CPU against CPU: checks this script, not a GPU
        print(json.dumps(check_v41(Path("checkpoints/v41-small"), "cpu")[0], indent=1))
        return 0
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
    v41_report, v41_ok = check_v41(Path(sys.argv[2] if len(sys.argv) > 2 else "checkpoints/v41-small"))
    report["v41"] = v41_report
    print(json.dumps(report, indent=1))
    return 0 if ok and v41_ok else 1


def check_v41(ckpt: Path, device: str = "cuda") -> tuple[dict, bool]:
    from engramflow.model.backbones import make_backbone, split_blocks
    from engramflow.io.checkpoint import Checkpoint

    if not (ckpt / "config.json").is_file():
        make_checkpoint("v41-small", ckpt, progress=False)
    cpu, gpu = Engine(ckpt, device="cpu"), Engine(ckpt, device=device)
    ids = cpu.encode(PROMPT)[:48]
    rels, same = [], 0
    for n in (1, 8, 17, 33, 48):
        a, b = cpu.open(), gpu.open()
        x, y = cpu.prefill(a, ids[:n]), gpu.prefill(b, ids[:n])
        rels.append(float((x - y).abs().max() / x.abs().max()))
        same += int(x.argmax() == y.argmax())
    # per-stage decode ms: two stages on the GPU, driven in process (what each stage actor runs)
    c = Checkpoint(ckpt)
    stages = [make_backbone("v41", c, b, device) for b in split_blocks(c.config.n_layers, 2)]
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    hist, mem = gpu.history, gpu.memory
    s = hist.open()
    for st in stages:
        st.open(s)
    ms = [0.0, 0.0]
    for t, tok in enumerate(ids):
        addr = hist.append(s, [tok], t)
        kv = {layer: mem.project(layer, addr) for layer in c.config.engram_layer_ids}
        x = torch.tensor([tok])
        for k, st in enumerate(stages):
            sync()
            t0 = time.perf_counter()
            x = st.forward(s, x, t, {l: (lambda l=l: kv[l]) for l in st.engram_layers}).h
            sync()
            ms[k] += (time.perf_counter() - t0) * 1e3 / len(ids)
    rep = {"prefill_max_rel_logit_diff": rels, "argmax_agree": f"{same}/{len(rels)}",
           "decode_ms_per_stage": ms}
    return rep, max(rels) < 0.5 and same >= len(rels) - 1


if __name__ == "__main__":
    sys.exit(main())
