"""The v41 backbone on the small V4.1 checkpoint (tests/data/v41_small): prefill and decode
tokens/s and ms per layer kind, against a plain dense-bf16 version of the same layers (every
FP8/FP4 weight dequantised once, bf16 F.linear, no activation quantisation), same run.

The official numerics cost the activation quantisation and the K-ordered block GEMM; the
dense model shows what plain bf16 arithmetic of the same shapes costs on this CPU.
The official-vs-dense rows run in official numerics (one forward per session, the official
code's shapes). Then the decode step with 1/4/16/64 sessions on the v41-small preset, batched
numerics (one forward per step) against official (one per session): v41_sessions.py.
Also the real-size Engram projection (wkv 25,600 x 6,144 FP8) per token in official numerics:
decode (T = 1, two Engram layers) and a 512-token prefill chunk.
"""
from __future__ import annotations

import dataclasses
import time
from collections import defaultdict
from pathlib import Path

import torch

from bench_projection import best, fp8_weight
from common import parser, print_machine, print_table, write_json
from engramflow.kernels.quant import QuantWeight, quant_linear
from engramflow.pipeline.engine import Engine
from v41_images import VISION, image_figures
from v41_sessions import session_figures

SMALL = Path(__file__).resolve().parent.parent / "tests" / "data" / "v41_small"


def densify(obj, seen=None) -> None:
    """Replace every QuantWeight reachable from obj by its dequantised bf16 weight."""
    seen = seen if seen is not None else set()
    if id(obj) in seen or isinstance(obj, (torch.Tensor, str, int, float, type(None))):
        return
    seen.add(id(obj))
    items = (list(enumerate(obj)) if isinstance(obj, list)
             else [(f.name, getattr(obj, f.name)) for f in dataclasses.fields(obj)] if dataclasses.is_dataclass(obj)
             else list(vars(obj).items()) if hasattr(obj, "__dict__") else [])
    for key, value in items:
        if isinstance(value, QuantWeight):
            dense = value.dequantized().bfloat16()
            obj.__setitem__(key, dense) if isinstance(obj, list) else setattr(obj, key, dense)
        else:
            densify(value, seen)


def kinds_ms(engine: Engine, spans_per_call: list, calls: int) -> dict[str, float]:
    roles = engine.stage.v41.roles
    out: dict[str, float] = defaultdict(float)
    for spans in spans_per_call:
        for s in spans:
            out[roles[s.block].kind] += (s.end_ns - s.start_ns) / 1e6 / calls
    return dict(out)


def measure(engine: Engine, ids: list[int], prompt: int, steps: int, repeat: int) -> dict:
    stage = engine.stage
    spans = []
    forward = stage.forward_step

    def recording(*a, **k):
        out = forward(*a, **k)
        spans.append(out.spans)
        return out

    stage.forward_step = recording
    try:
        best_prefill, best_decode = float("inf"), float("inf")
        for _ in range(repeat):
            s = engine.open()
            spans.clear()
            t = time.perf_counter()
            engine.prefill(s, ids[:prompt])
            best_prefill = min(best_prefill, time.perf_counter() - t)
            prefill_kinds = kinds_ms(engine, spans, 1)
            spans.clear()
            t = time.perf_counter()
            for tok in ids[prompt:prompt + steps]:
                engine.decode_step({s: tok})
            best_decode = min(best_decode, time.perf_counter() - t)
            decode_kinds = kinds_ms(engine, spans, steps)
            engine.close(s)
    finally:
        stage.forward_step = forward
    return {"prefill_tokens_per_s": prompt / best_prefill, "decode_tokens_per_s": steps / best_decode,
            "prefill_kinds_ms": prefill_kinds, "decode_kinds_ms": decode_kinds}


def engram_projection_ms(quick: bool) -> dict:
    """Official-numerics wkv at real size: ms per token for decode (two layers) and a prefill chunk."""
    codes, scale = fp8_weight(25_600, 6_144)
    tiles = scale.repeat_interleave(4, 0).repeat_interleave(4, 1)
    w = QuantWeight.fp8(codes.view(torch.float8_e4m3fn), tiles.view(torch.float8_e8m0fnu))
    x1, chunk = torch.randn(1, 6_144).bfloat16(), torch.randn(128 if quick else 512, 6_144).bfloat16()
    quant_linear(x1, w)
    decode = best(lambda: quant_linear(x1, w), 5) * 1e3
    prefill = best(lambda: quant_linear(chunk, w), 1 if quick else 2) * 1e3 / chunk.shape[0]
    return {"decode_ms_per_layer": decode, "decode_ms_per_token_two_layers": 2 * decode,
            "prefill_chunk": chunk.shape[0], "prefill_ms_per_token_per_layer": prefill}


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--prompt", type=int, default=96)
    p.add_argument("--steps", type=int, default=24)
    args = p.parse_args()
    repeat = 2 if args.quick else 5
    torch.manual_seed(0)
    ids = torch.randint(0, 512, (args.prompt + args.steps,)).tolist()
    official = Engine(SMALL, backbone="v41", numerics="official")
    dense = Engine(SMALL, backbone="v41", numerics="official")
    densify(dense.stage)
    res = {"official": measure(official, ids, args.prompt, args.steps, repeat),
           "dense_bf16": measure(dense, ids, args.prompt, args.steps, repeat)}
    rows = [{"model": name, "prefill tok/s": r["prefill_tokens_per_s"], "decode tok/s": r["decode_tokens_per_s"],
             "prefill vs dense": r["prefill_tokens_per_s"] / res["dense_bf16"]["prefill_tokens_per_s"],
             "decode vs dense": r["decode_tokens_per_s"] / res["dense_bf16"]["decode_tokens_per_s"]}
            for name, r in res.items()]
    print_machine()
    print(f"v41 small ({SMALL.name}): prompt {args.prompt} tokens, {args.steps} decode steps, best of {repeat}")
    print_table(rows, list(rows[0]))
    kinds = sorted(res["official"]["prefill_kinds_ms"])
    krows = [{"layer kind": k,
              **{f"{phase} {name} ms": res[name][f"{phase}_kinds_ms"].get(k, 0.0)
                 for phase in ("prefill", "decode") for name in res}} for k in kinds]
    print("\nms per layer kind (prefill: whole prompt; decode: per step)")
    print_table(krows, list(krows[0]))
    engram = engram_projection_ms(args.quick)
    print(f"\nreal-size Engram projection, official numerics: decode {engram['decode_ms_per_layer']:.2f} ms per layer "
          f"({engram['decode_ms_per_token_two_layers']:.2f} ms per token for two layers); prefill chunk of "
          f"{engram['prefill_chunk']}: {engram['prefill_ms_per_token_per_layer']:.3f} ms per token per layer")
    sessions = session_figures(3 if args.quick else 7)
    print(f"\ndecode step with N sessions on the v41-small preset (best of {3 if args.quick else 7} steps)")
    print_table(sessions, list(sessions[0]))
    images = image_figures(repeat)
    print(f"\nimages ({VISION.name}): encode time per image (best of {repeat})")
    print_table(images["encode"], list(images["encode"][0]))
    print("\nprefill with vs without an image")
    print_table(images["prefill"], list(images["prefill"][0]))
    write_json(args.json, {"prompt": args.prompt, "steps": args.steps, "results": res, "rows": rows,
                           "engram_projection": engram, "sessions": sessions, "images": images})


if __name__ == "__main__":
    main()
