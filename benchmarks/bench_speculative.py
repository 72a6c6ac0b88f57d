"""Adaptive (confidence-gated) speculative decoding vs always drafting vs plain decoding.

`dspark[:K]:adaptive[=P]` drafts only while the draft layers are confident: after a draft whose
first token's confidence (sigmoid of the confidence logit) is below P, the next steps decode
plainly (waiting 1, 2, 4, up to 8 steps while the drafts stay unconfident). It changes the cost,
never the tokens (greedy output is asserted equal to plain decoding in every run).

(1) The emulated backbone (tiny checkpoint; a block's time does not depend on the tokens in a
forward, as on a GPU at batch 1; drafting costs 3 blocks' time) with an injected drafter
(pipeline/speculative_emulated.py): text of easy and hard stretches, per-draft acceptance
`easy` / `hard`, a stretch ending with probability `switch` per token, and a confidence that
says whether a draft is right. Scenarios: stretches (0.9 / 0.05), uniform 0.5, uniform 0.1,
uniform 0.9. Decode tokens/s (prefill apart) of plain, always drafting, and adaptive at P = 0.5
and 0.8; and, since a short run's timings are noisy on a shared machine, the timing model's
speed-up from the run's (deterministic) tokens per step and share of steps that drafted:
    model_vs_plain = tokens_per_step / (1 + drafted_share * draft_ms / plain_step_ms)
(a verify step costs a plain step on this backbone, a draft 3 blocks).
(2) v41-small on the CPU (random weights: its own draft layers, its own confidence): whole-run
tokens/s of plain, `dspark`, `dspark:adaptive`.
"""
from __future__ import annotations

import time
from pathlib import Path

from common import args_with_tiny_checkpoint, print_table, write_json
from engramflow.model.synth import make_checkpoint
from engramflow.pipeline.engine import Engine
from engramflow.pipeline.speculative_emulated import InjectedAcceptanceEngine

PROMPT = [101, 202, 303, 404]
SCENARIOS = [  # name, easy acceptance, hard acceptance (None: uniform), switch per token
    ("stretches 0.9/0.05", 0.9, 0.05, 1 / 24),
    ("uniform 0.5", 0.5, None, 0.0),
    ("uniform 0.1", 0.1, None, 0.0),
    ("uniform 0.9", 0.9, None, 0.0),
]
THRESHOLDS = (0.5, 0.8)


def plain_decode(ckpt: Path, new_tokens: int, block_ms: float) -> tuple[list[int], float]:
    """Plain greedy tokens and decode tokens/s (prefill apart) on the emulated backbone."""
    e = Engine(ckpt, backbone="emulated", block_ms=block_ms)
    e.generate([PROMPT], max_new_tokens=2)  # warm up
    s = e.open()
    tokens = [int(e.prefill(s, PROMPT).argmax())]
    t = time.perf_counter()
    while len(tokens) < new_tokens:
        tokens.append(int(e.decode_step({s: tokens[-1]})[s].argmax()))
    seconds = time.perf_counter() - t
    e.close(s)
    e.shutdown()
    return tokens, (new_tokens - 1) / seconds


def emulated(ckpt: Path, new_tokens: int, k: int = 5, block_ms: float = 1.0) -> list[dict]:
    reference, plain_tps = plain_decode(ckpt, new_tokens, block_ms)
    draft_per_step = 3 * block_ms / (1e3 / plain_tps)  # a draft's cost in plain steps
    rows = []
    for name, easy, hard, switch in SCENARIOS:
        row = {"scenario": name, "plain_tokens_per_s": plain_tps}
        for threshold in (None, *THRESHOLDS):
            e = InjectedAcceptanceEngine(ckpt, k, easy, draft_ms=3 * block_ms, block_ms=block_ms, hard=hard,
                                         switch=switch, threshold=threshold)
            e.plant([PROMPT], [reference])
            e.generate([PROMPT], max_new_tokens=2)  # warm up
            e.right = e.made = 0
            assert e.generate([PROMPT], max_new_tokens=new_tokens)[0].tokens == reference, "tokens differ from plain"
            st = e.speculative_stats
            tps = (new_tokens - 1) / (st.draft_s + st.verify_s)
            key = "always" if threshold is None else f"adaptive_{threshold:g}"
            row |= {f"{key}_tokens_per_s": tps, f"{key}_vs_plain": tps / plain_tps,
                    f"{key}_drafted_steps": st.draft_steps / st.steps, f"{key}_tokens_per_step": st.tokens_per_step,
                    f"{key}_model_vs_plain": st.tokens_per_step / (1 + st.draft_steps / st.steps * draft_per_step)}
            if threshold is None:
                row["realized_acceptance"] = e.right / max(1, e.made)
            e.shutdown()
        rows.append(row)
    return rows


def v41_small(new_tokens: int) -> list[dict]:
    ckpt = Path(__file__).resolve().parents[1] / "checkpoints" / "v41-small"  # the repository's (ignored) folder
    if not (ckpt / "config.json").is_file():
        make_checkpoint("v41-small", ckpt)
    prompt = [[1000 + 37 * i for i in range(16)]]
    rows, reference = [], None
    for spec in (None, "dspark", "dspark:adaptive", "dspark:adaptive=0.8"):
        e = Engine(ckpt, speculative=spec)
        e.generate(prompt, max_new_tokens=3)  # warm up
        g = e.generate(prompt, max_new_tokens=new_tokens)[0]
        reference = reference or g.tokens  # (not exact: batched verify rows may move a last bit on the CPU)
        row = {"mode": spec or "plain", "tokens_per_s": g.tokens_per_s, "same_tokens_as_plain": g.tokens == reference}
        if spec is not None:
            st = e.speculative_stats
            row |= {"acceptance": st.acceptance, "tokens_per_step": st.tokens_per_step,
                    "drafted_steps": st.draft_steps / st.steps, "draft_ms_per_step": st.draft_s / st.steps * 1e3,
                    "verify_ms_per_step": st.verify_s / st.steps * 1e3}
        rows.append(row)
        e.shutdown()
    for r in rows:
        r["vs_plain"] = r["tokens_per_s"] / rows[0]["tokens_per_s"]
    return rows


def main() -> None:
    args, ckpt = args_with_tiny_checkpoint(__doc__)
    emu = emulated(ckpt, 48 if args.quick else 240)
    print("adaptive speculative decoding, emulated backbone (K = 5, 1 ms per block x 16, draft = 3 blocks):")
    keys = ["always", *(f"adaptive_{t:g}" for t in THRESHOLDS)]
    print_table(emu, ["scenario", "realized_acceptance", "plain_tokens_per_s"]
                + [f"{k}_tokens_per_s" for k in keys] + [f"{k}_vs_plain" for k in keys])
    print("\nshare of steps that drafted, and tokens per step:")
    print_table(emu, ["scenario"] + [f"{k}_drafted_steps" for k in keys] + [f"{k}_tokens_per_step" for k in keys])
    print("\nthe timing model's speed-up over plain decoding (noise-free: from the two rows above):")
    print_table(emu, ["scenario"] + [f"{k}_model_vs_plain" for k in keys])
    real = v41_small(8 if args.quick else 48)
    print("\nv41-small on the CPU (random weights: its own draft layers and confidence):")
    print_table(real, ["mode", "tokens_per_s", "vs_plain", "same_tokens_as_plain", "acceptance", "tokens_per_step",
                       "drafted_steps", "draft_ms_per_step", "verify_ms_per_step"])
    write_json(args.json, {"emulated": emu, "v41_small": real})


if __name__ == "__main__":
    main()
