"""access-stats throughput: Ray Data actors vs the same counting in one process, on the bundled
Python-docs dataset; then the dataset's coverage figures (share of accesses served by the top-K
rows, K = 1 .. 10,000, per Engram layer and n-gram size)."""
from __future__ import annotations

import tempfile
import time
from pathlib import Path

from common import parser, print_table, write_json
from engramflow.data.access.stats import access_stats, count_in_process
from engramflow.data.access.counts import coverage, split_by_ngram
from engramflow.data.datasets import make_table, write_table
from engramflow.io.layout import build_layout
from engramflow.io.presets import preset

COVERAGE_KS = (1, 10, 100, 1_000, 10_000)


def coverage_rows(cfg, merged) -> list[dict]:
    layout = build_layout(cfg)
    rows = []
    for li, (layer_rows, counts) in enumerate(merged):
        groups = {f"{n}-gram": c for n, (_, c) in split_by_ngram(layout, li, layer_rows, counts).items()}
        groups["all"] = counts
        for name, c in groups.items():
            shares = dict(coverage(c, COVERAGE_KS))
            rows.append({"layer": cfg.engram_layer_ids[li], "ngram": name, "unique_rows": int(c.size),
                         **{f"top{k}": shares[k] for k in COVERAGE_KS}})
    return rows


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--concurrency", type=int, default=2, help="Ray Data actors")
    args = p.parse_args()
    import ray
    from ray.data import DataContext

    cfg = preset("deepseek-v4.1-flash")
    table = make_table(rows=300 if args.quick else None)
    tmp = Path(tempfile.mkdtemp(prefix="bench_access_stats_"))
    data = write_table(table, tmp / "docs.parquet")

    t0 = time.perf_counter()
    merged, totals = count_in_process(table, cfg)
    local_s = time.perf_counter() - t0
    tokens = totals["tokens"]

    ray.init(num_cpus=args.concurrency + 1, include_dashboard=False, log_to_driver=False)
    DataContext.get_current().enable_progress_bars = False  # keep the table readable
    runs = [access_stats(data, tmp / f"out{i}", cfg=cfg, concurrency=args.concurrency) for i in range(2)]
    ray.shutdown()
    assert all(r["tokens"] == tokens for r in runs)

    rows = [{"mode": "single process", "tokens": tokens, "seconds": local_s, "tokens_per_s": tokens / local_s,
             "ratio": 1.0}]
    for label, run in zip(("ray data, cold actors", "ray data, 2nd run"), runs):
        rows.append({"mode": f"{label} (x{args.concurrency})", "tokens": tokens, "seconds": run["seconds"],
                     "tokens_per_s": run["tokens_per_s"], "ratio": local_s / run["seconds"]})
    print(f"{table.num_rows} paragraphs of the bundled Python docs, {tokens} tokens")
    print_table(rows, ["mode", "tokens", "seconds", "tokens_per_s", "ratio"])
    print()
    cov = coverage_rows(cfg, merged)
    print("share of accesses served by the K most-accessed rows")
    print_table(cov, ["layer", "ngram", "unique_rows", *(f"top{k}" for k in COVERAGE_KS)])
    write_json(args.json, {"dataset_rows": table.num_rows, "tokens": tokens, "throughput": rows, "coverage": cov})


if __name__ == "__main__":
    main()
