"""`engramflow timing-model`: decode tokens/s and slowdown per storage path and base speed; with
`--prefill`, TTFT per prompt length with host vs stage projection (profiling/prefill_model.py)."""
from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

from engramflow.cli.plots import heatmap_figure, save, ttft_figure
from engramflow.errors import EngramflowError
from engramflow.profiling.timing_model import PATHS_MS, path_fetch_ms, predict


def measured_paths(bench_dir: Path = Path("out")) -> dict[str, float]:
    """Per-table fetch p50s that the project's benchmarks wrote (bench_tiers JSON), if any."""
    path = bench_dir / "bench_tiers.json"
    if not path.is_file():
        return {}
    try:
        doc = json.loads(path.read_text())
        return {f"measured-{r['tier']}": float(r["p50_us"]) / 1000 for r in doc.get("rows", [])
                if r.get("rows_per_fetch") == 24}
    except (ValueError, KeyError, TypeError):
        return {}


def parse_floats(text: str, what: str) -> list[float]:
    try:
        vals = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise EngramflowError(f"{what} must be comma-separated numbers, got {text!r}") from None
    if not vals:
        raise EngramflowError(f"{what} is empty")
    return vals


def wrote(path: Path) -> None:
    """Every picture's path, on stderr (stdout may be JSON)."""
    print(f"engramflow timing-model: wrote {path}", file=sys.stderr)


def cmd_timing_model(args) -> int:
    if args.prefill:
        return cmd_prefill(args)
    speeds = parse_floats(args.base_tps, "--base-tps")
    measured = measured_paths()
    if args.f0_ms is not None or args.f1_ms is not None:
        if args.f0_ms is None or args.f1_ms is None:
            raise EngramflowError("--f0-ms and --f1-ms go together")
        cases = [("custom", args.f0_ms, args.f1_ms)]
    else:
        names = args.path.split(",") if args.path else sorted(PATHS_MS | measured)
        cases = [(n, path_fetch_ms(n, measured), path_fetch_ms(n, measured)) for n in names]
    chained = args.model == "chained"
    rows = [predict(s, f0, f1, path=name, chained=chained) for name, f0, f1 in cases for s in speeds]
    if args.json:
        print(json.dumps({"rows": [dataclasses.asdict(r) for r in rows]}))
    else:
        print(f"{'path':>20} {'base tok/s':>10} {'f0 ms':>8} {'f1 ms':>8} {'tok/s':>9} {'slowdown':>8}")
        for r in rows:
            print(f"{r.path:>20} {r.base_tps:>10.1f} {r.f0_ms:>8.3f} {r.f1_ms:>8.3f} {r.tokens_per_s:>9.1f} {r.slowdown:>8.3f}")
    if args.heatmap:
        wrote(save(heatmap_figure(rows), args.heatmap))
    return 0


# A realistic cluster (README): 8 H200-class stages in one box with a 2-socket table host, PCIe 5.
CLUSTER = {
    "host_gflops": 10_000.0,  # one socket: 72 of 96 Zen 4 cores (3/4: docs/architecture.md, "Actors") x ~140 GFLOP/s BF16 each
    "host_gbps": 300.0,  # one socket's DDR5, achieved
    "host_share": 1,  # one projection actor per socket: one Engram layer each
    "device_tflops": 600.0,  # H200 dense BF16 at ~60 % of 989
    "device_gbps": 4000.0,
    "link_gbps": 50.0,  # PCIe 5 x16, achieved
    "link_latency_ms": 1.0,  # a Ray actor hop (docs/architecture.md, "Timing model")
    "stages": 8,
    "backbone_ms_per_token": 26e9 / (989e12 * 0.4) * 1e3,  # ~13 B active params: 26 GFLOP/token at 40 % MFU
    "chunk": 8192,
    "gather_us_per_token": 15.0,  # host row gather per token and layer, one thread (as implemented)
}


def prefill_figures(args):
    from engramflow.profiling.prefill_model import PrefillFigures

    given = {k: getattr(args, k) for k in CLUSTER if getattr(args, k, None) is not None}
    extra = {k: getattr(args, k) for k in ("backbone_ms_per_chunk",) if getattr(args, k, None) is not None}
    return PrefillFigures(**(CLUSTER | given | extra))


def cmd_prefill(args) -> int:
    from engramflow.profiling.prefill_model import predict_prefill

    lengths = [int(v) for v in parse_floats(args.prompt_lengths, "--prompt-lengths")]
    fig = prefill_figures(args)
    rows = predict_prefill(fig, lengths, pipelined=False) + predict_prefill(fig, lengths, pipelined=True)
    if args.json:
        print(json.dumps({"figures": dataclasses.asdict(fig), "rows": [dataclasses.asdict(r) for r in rows]}))
    else:
        print("inputs: " + ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}"
                                     for k, v in dataclasses.asdict(fig).items()))
        print(f"{'prompt':>8} {'placement':>9} {'serial TTFT s':>14} {'pipelined TTFT s':>17}")
        for p in lengths:
            for pl in ("host", "stage"):
                ser, pipe = (next(r.ttft_ms for r in rows if r.prompt_tokens == p and r.placement == pl
                                  and r.pipelined == flag) for flag in (False, True))
                print(f"{p:>8} {pl:>9} {ser / 1e3:>14.3f} {pipe / 1e3:>17.3f}")
    if args.plot:
        wrote(save(ttft_figure(rows, _reference(args.reference) if args.reference else None), args.plot))
    return 0


def _reference(text: str) -> tuple[int, float, str]:
    """"TOKENS:SECONDS:NAME", e.g. "51200:26:zLLM (published)"."""
    try:
        tokens, seconds, name = text.split(":", 2)
        return int(tokens), float(seconds), name
    except ValueError:
        raise EngramflowError(f"--reference must be TOKENS:SECONDS:NAME, got {text!r}") from None


def register(sub) -> None:
    p = sub.add_parser("timing-model", help="predict decode tokens/s for Engram storage paths (docs/architecture.md)")
    p.add_argument("--base-tps", default="25,50,100,200,300,600", help="base speeds without Engram stalls, tokens/s")
    p.add_argument("--path", help=f"comma-separated storage paths (known: {', '.join(PATHS_MS)})")
    p.add_argument("--f0-ms", type=float, help="table 0 fetch time, ms from step start")
    p.add_argument("--f1-ms", type=float, help="table 1 fetch time, ms from step start")
    p.add_argument("--model", choices=["design", "chained"], default="design",
                   help="design: the timing model as written (late tables add); chained: an L1 stall also delays L14's window")
    p.add_argument("--json", action="store_true", help="print JSON rows")
    p.add_argument("--heatmap", help="write a heatmap PNG of the slowdown here")
    p.add_argument("--prefill", action="store_true",
                   help="predict TTFT per prompt length with host vs stage projection instead (defaults: 8 H200-class "
                        "stages over PCIe 5 with a 2-socket table host; README)")
    p.add_argument("--prompt-lengths", default="512,2048,8192,16384,32768,51200",
                   help="--prefill: prompt lengths in tokens, comma-separated")
    for name, help_ in (("host-gflops", "one projection actor's GEMM rate, GFLOP/s"),
                        ("host-gbps", "one projection actor's memory read bandwidth, GB/s"),
                        ("device-tflops", "a stage device's projection GEMM rate, TFLOP/s"),
                        ("device-gbps", "a stage device's memory bandwidth, GB/s"),
                        ("link-gbps", "table host -> stage bandwidth, GB/s"),
                        ("link-latency-ms", "per transfer and per stage hop, ms"),
                        ("backbone-ms-per-token", "the whole backbone's prefill time per token, ms"),
                        ("backbone-ms-per-chunk", "the whole backbone's fixed time per chunk, ms"),
                        ("gather-us-per-token", "host row gather per token and layer, us")):
        p.add_argument(f"--{name}", type=float, help=help_)
    for name, help_ in (("stages", "stage count"), ("chunk", "prefill chunk, tokens"),
                        ("host-share", "Engram layers one projection actor serves at once")):
        p.add_argument(f"--{name}", type=int, help=help_)
    p.add_argument("--plot", help="write TTFT vs prompt length (PNG) here")
    p.add_argument("--reference", default="51200:26:zLLM, published (50K tokens)",
                   help="a point to mark on the plot, TOKENS:SECONDS:NAME")
    p.set_defaults(func=cmd_timing_model)
