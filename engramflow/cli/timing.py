"""`engramflow timing-model`: tokens/s and slowdown per storage path and base speed."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

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


def cmd_timing_model(args) -> int:
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
        draw_heatmap(rows, Path(args.heatmap))
    return 0


def draw_heatmap(rows, out: Path) -> None:
    from matplotlib.figure import Figure  # no pyplot: the caller's backend stays as it is
    import numpy as np

    paths = list(dict.fromkeys(r.path for r in rows))
    speeds = list(dict.fromkeys(r.base_tps for r in rows))
    grid = np.array([[next(r.slowdown for r in rows if r.path == p and r.base_tps == s) for s in speeds] for p in paths])
    fig = Figure(figsize=(1.2 + 0.9 * len(speeds), 1 + 0.5 * len(paths)))
    ax = fig.subplots()
    im = ax.imshow(grid, cmap="magma_r", aspect="auto")
    ax.set_xticks(range(len(speeds)), [f"{s:g}" for s in speeds])
    ax.set_yticks(range(len(paths)), paths)
    ax.set_xlabel("base speed (tokens/s)")
    ax.set_title("decode slowdown from Engram fetch (T / W)")
    for i in range(len(paths)):
        for j in range(len(speeds)):
            ax.text(j, i, f"{grid[i, j]:.2f}", ha="center", va="center", color="white" if grid[i, j] > grid.max() / 2 else "black", fontsize=8)
    fig.colorbar(im, ax=ax)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)


def register(sub) -> None:
    p = sub.add_parser("timing-model", help="predict decode tokens/s for Engram storage paths (DESIGN §4)")
    p.add_argument("--base-tps", default="25,50,100,200,300,600", help="base speeds without Engram stalls, tokens/s")
    p.add_argument("--path", help=f"comma-separated storage paths (known: {', '.join(PATHS_MS)})")
    p.add_argument("--f0-ms", type=float, help="table 0 fetch time, ms from step start")
    p.add_argument("--f1-ms", type=float, help="table 1 fetch time, ms from step start")
    p.add_argument("--model", choices=["design", "chained"], default="design",
                   help="design: DESIGN §4 (late tables add); chained: an L1 stall also delays L14's window")
    p.add_argument("--json", action="store_true", help="print JSON rows")
    p.add_argument("--heatmap", help="write a heatmap PNG of the slowdown here")
    p.set_defaults(func=cmd_timing_model)
