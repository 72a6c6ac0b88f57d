"""Pipeline vs Engine on the tiny checkpoint: decode tokens/s (ratio = what Ray costs),
per-step Ray overhead, and the exposed Engram wait per layer, for 1 and 2 stages; then
micro-batches: the emulated backbone (blocks sleep like a GPU's, Engram stays real) on 4
stages with 16 sessions, decode throughput with 4 groups in flight vs 1 group, same tokens.

`ms_per_step` is the run's time over its decode rounds (every session one token); the Ray
overhead per step is that minus the Engine's. Each Pipeline row keeps `in_flight` steps in
flight (its default: one per stage; the extra rows at 1 stage keep 2, which hides the
driver's and the Engram actors' hops behind the stage's compute).
Warm-up (a 2-token generate) is excluded from every timing.

Speculative decoding (DSpark, K = 5 drafts per step): random weights accept nothing, so speed is
shown two ways. (1) The emulated backbone (a block's time does not depend on the tokens in a
forward) with drafts injected right at a rate of 0, 50 and 90 % (each drafting costs 3 blocks'
time, as the 3 draft layers would): decode tokens/s vs plain decode, and the timing model's
figure from the acceptance rate, the measured draft cost and the measured verification cost
(pipeline/speculative_emulated.py). (2) The v41-small model's own draft layers: the real
acceptance rate and the cost per step."""
from __future__ import annotations

import time
from pathlib import Path

from common import args_with_tiny_checkpoint, print_table, write_json
from engramflow.model.synth import make_checkpoint
from engramflow.pipeline.engine import Engine
from engramflow.pipeline.pipeline import Pipeline
from engramflow.pipeline.speculative_emulated import InjectedAcceptanceEngine, model_tokens_per_s

PROMPTS = ["Engram memory lets a model look things up", "The quick brown fox", "Ray actors overlap work",
           "Tables stay in host memory"]


def run(runner, new_tokens: int, batch: int, in_flight: int = 1, prompts=PROMPTS) -> dict:
    runner.generate(prompts[:1], max_new_tokens=2, in_flight=1)  # warm up
    t = time.perf_counter()
    gens = runner.generate(prompts[:batch], max_new_tokens=new_tokens, in_flight=in_flight)
    seconds = time.perf_counter() - t
    steps = new_tokens - 1
    return {"tokens_per_s": batch * new_tokens / seconds, "ms_per_step": seconds / max(1, steps) * 1e3,
            "wait_L1_ms": gens[0].exposed_wait_ms.get(1, 0.0), "wait_L14_ms": gens[0].exposed_wait_ms.get(14, 0.0),
            "tokens": [g.tokens for g in gens]}


def microbatch(ckpt: Path, new_tokens: int, stages: int = 4, sessions: int = 16, block_ms: float = 2.0) -> dict:
    """Emulated backbone: decode throughput with `stages` groups in flight vs one group."""
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} {i}" for i in range(sessions)]
    pipe = Pipeline.launch(ckpt, stages=stages, backbone="emulated", block_ms=block_ms)
    try:
        one = run(pipe, new_tokens, sessions, 1, prompts)
        many = run(pipe, new_tokens, sessions, stages, prompts)
    finally:
        pipe.shutdown()
    assert one["tokens"] == many["tokens"], "groups in flight changed the tokens"
    return {"stages": stages, "sessions": sessions, "block_ms": block_ms, "new_tokens": new_tokens,
            "one_group_tokens_per_s": one["tokens_per_s"], "in_flight_tokens_per_s": many["tokens_per_s"],
            "speedup": many["tokens_per_s"] / one["tokens_per_s"], "ideal_speedup": stages}


def speculative(ckpt: Path, new_tokens: int, k: int = 5, block_ms: float = 2.0) -> list[dict]:
    """Injected acceptance on the emulated backbone vs plain decode, and the timing model."""
    prompt = [[101, 202, 303, 404]]
    plain = Engine(ckpt, backbone="emulated", block_ms=block_ms)
    plain.generate(prompt, max_new_tokens=2)  # warm up
    t = time.perf_counter()
    reference = plain.generate(prompt, max_new_tokens=new_tokens)[0].tokens
    plain_s = time.perf_counter() - t
    s = plain.open()
    t = time.perf_counter()
    plain.prefill(s, prompt[0])
    prefill_s = time.perf_counter() - t
    plain.close(s)
    plain_tps = (new_tokens - 1) / max(1e-9, plain_s - prefill_s)  # decode steps only
    rows = []
    for acceptance in (0.0, 0.5, 0.9):
        e = InjectedAcceptanceEngine(ckpt, k, acceptance, draft_ms=3 * block_ms, block_ms=block_ms)
        e.plant(prompt, [reference])
        e.generate(prompt, max_new_tokens=2)  # warm up
        e.right = e.made = 0
        tokens = e.generate(prompt, max_new_tokens=new_tokens)[0].tokens
        assert tokens == reference, "speculative greedy output differs from plain greedy"
        st = e.speculative_stats
        draft_s = st.draft_s / max(1, st.draft_steps)
        verify_s = st.verify_s / st.steps
        rows.append({"acceptance": acceptance, "tokens_per_s": (new_tokens - 1) / (st.draft_s + st.verify_s),
                     "plain_tokens_per_s": plain_tps,
                     "model_tokens_per_s": model_tokens_per_s(e.right / max(1, e.made), k, draft_s, verify_s,
                                                              new_tokens),
                     "realized_acceptance": e.right / max(1, e.made),
                     "kept_per_draft": st.acceptance, "tokens_per_step": st.tokens_per_step,
                     "draft_ms": draft_s * 1e3, "verify_ms": verify_s * 1e3, "plain_step_ms": 1e3 / plain_tps})
        e.shutdown()
    plain.shutdown()
    for r in rows:
        r["model_error"] = r["tokens_per_s"] / r["model_tokens_per_s"] - 1
        r["vs_plain"] = r["tokens_per_s"] / r["plain_tokens_per_s"]
    return rows


def v41_small_speculative(new_tokens: int) -> dict:
    """The v41-small preset's own draft layer: real acceptance and cost per step."""
    ckpt = Path(__file__).resolve().parents[1] / "checkpoints" / "v41-small"  # the repository's (ignored) folder
    if not (ckpt / "config.json").is_file():
        make_checkpoint("v41-small", ckpt)
    prompt = [[1000 + 37 * i for i in range(16)]]
    e = Engine(ckpt, speculative="dspark")
    e.generate(prompt, max_new_tokens=new_tokens)
    st = e.speculative_stats
    e.shutdown()
    return {"acceptance": st.acceptance, "tokens_per_step": st.tokens_per_step, "steps": st.steps,
            "draft_ms_per_step": st.draft_s / st.steps * 1e3, "verify_ms_per_step": st.verify_s / st.steps * 1e3}


def main() -> None:
    args, ckpt = args_with_tiny_checkpoint(__doc__)
    new_tokens = 8 if args.quick else 32
    rows = []
    for batch in (1, 4):
        base = run(Engine(ckpt), new_tokens, batch) | {"runner": "Engine", "stages": 1, "sessions": batch,
                                                       "in_flight": 1}
        rows.append(base)
        for stages, in_flight in ((1, 1), (1, 2), (2, 2)):
            pipe = Pipeline.launch(ckpt, stages=stages, in_flight=in_flight)
            try:
                r = run(pipe, new_tokens, batch, in_flight)
            finally:
                pipe.shutdown()
            assert r["tokens"] == base["tokens"], "the pipeline's tokens differ from the Engine's"
            r |= {"runner": "Pipeline", "stages": stages, "sessions": batch, "in_flight": in_flight,
                  "vs_engine": r["tokens_per_s"] / base["tokens_per_s"],
                  "ray_overhead_ms_per_step": r["ms_per_step"] - base["ms_per_step"]}
            rows.append(r)
    for r in rows:
        del r["tokens"]
    print_table(rows, ["runner", "stages", "in_flight", "sessions", "tokens_per_s", "ms_per_step", "vs_engine",
                       "ray_overhead_ms_per_step", "wait_L1_ms", "wait_L14_ms"])
    mb = microbatch(ckpt, 8 if args.quick else 16)
    print(f"\nmicro-batches (emulated backbone, {mb['block_ms']} ms per block, {mb['stages']} stages, "
          f"{mb['sessions']} sessions, same tokens):")
    print_table([mb], ["stages", "sessions", "one_group_tokens_per_s", "in_flight_tokens_per_s", "speedup",
                       "ideal_speedup"])
    spec = speculative(ckpt, 24 if args.quick else 200)
    print("\nspeculative decoding, emulated backbone (K = 5, injected acceptance; model: E(a, K) / (draft + verify)):")
    print_table(spec, ["acceptance", "realized_acceptance", "tokens_per_s", "plain_tokens_per_s", "model_tokens_per_s", "model_error",
                       "vs_plain", "tokens_per_step", "draft_ms", "verify_ms", "plain_step_ms"])
    real = v41_small_speculative(8 if args.quick else 48)
    print(f"\nv41-small's own draft layer (random weights): acceptance {real['acceptance']:.3f}, "
          f"{real['tokens_per_step']:.2f} tokens per step, draft {real['draft_ms_per_step']:.1f} ms + verify "
          f"{real['verify_ms_per_step']:.1f} ms per step")
    write_json(args.json, {"rows": rows, "microbatch": mb, "speculative": spec, "speculative_v41_small": real})


if __name__ == "__main__":
    main()
