"""access-stats outputs: `stats.json`, one hot-row list per layer and `coverage.png`.

Hot-row list format (`hot_rows_layer{L}.npy`, L = the Engram layer id): a NumPy `.npy` file
holding int64 [K, 2]; column 0 = row id in that layer's table, column 1 = access count;
sorted by count descending, ties by row id ascending. Load with `np.load(path)`.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from engramflow.data.access.counts import coverage, hot_rows, split_by_ngram

HOT_ROWS_FORMAT = "npy int64 [K, 2]: (row id, access count), count descending, ties by row ascending"


def hot_rows_name(layer_id: int) -> str:
    return f"hot_rows_layer{layer_id}.npy"


def _summary(rows: np.ndarray, counts: np.ndarray) -> dict:
    return {"accesses": int(counts.sum()), "unique_rows": int(rows.size),
            "coverage": [{"k": k, "share": share} for k, share in coverage(counts)]}


def layer_stats(layout, layer: int, rows: np.ndarray, counts: np.ndarray) -> dict:
    """One Engram layer: all its columns together, then per n-gram size."""
    by_ngram = split_by_ngram(layout, layer, rows, counts)
    return {"layer_id": int(layout.layer_ids[layer]), **_summary(rows, counts),
            "hot_rows_file": hot_rows_name(layout.layer_ids[layer]),
            "by_ngram": {str(n): _summary(r, c) for n, (r, c) in by_ngram.items()}}


def write_hot_rows(out_dir: Path, layout, merged, top_k: int) -> None:
    for layer, (rows, counts) in enumerate(merged):
        np.save(out_dir / hot_rows_name(layout.layer_ids[layer]), hot_rows(rows, counts, top_k))


def write_stats(out_dir: Path, stats: dict) -> Path:
    path = out_dir / "stats.json"
    path.write_text(json.dumps(stats, indent=2))
    return path


def _curve(counts: np.ndarray, points: int = 200) -> tuple[np.ndarray, np.ndarray]:
    """The full top-K share curve at log-spaced K (the decades in stats.json are too coarse to plot)."""
    cum = np.cumsum(np.sort(counts)[::-1])
    ks = np.unique(np.geomspace(1, counts.size, points).astype(np.int64))
    return ks, cum[ks - 1] / cum[-1]


def plot_coverage(path: Path, layout, merged) -> Path:
    coverage_figure(layout, merged).savefig(path, dpi=100)
    return path


def coverage_figure(layout, merged):
    """One panel per Engram layer: the share of accesses the K most-accessed rows serve, per
    n-gram size and for all columns, on a log K axis."""
    from matplotlib.figure import Figure  # no pyplot: the caller's backend stays as it is

    fig = Figure(figsize=(6 * len(merged), 4.5))
    axes = fig.subplots(1, len(merged), squeeze=False)
    for layer, (rows, counts) in enumerate(merged):
        ax = axes[0, layer]
        curves = {f"{n}-gram": c for n, (_, c) in split_by_ngram(layout, layer, rows, counts).items()}
        curves["all columns"] = counts
        for (label, c), style in zip(curves.items(), ("--", "-.", ":", "-", (0, (5, 1, 1, 1)))):
            if c.size:  # a line style each, so the curves part without colour too; "all" solid
                ks, share = _curve(c)
                ax.plot(ks, share, linestyle="-" if label == "all columns" else style,
                        label=f"{label} ({c.size:,} rows)")
        ax.set_xscale("log")
        ax.set_ylim(0, 1.02)
        ax.set_xlabel("K most-accessed rows")
        ax.set_ylabel("share of accesses served")
        ax.set_title(f"Engram layer {layout.layer_ids[layer]}")
        ax.grid(True, which="both", alpha=0.3)
        if counts.size:  # no accesses at all (every row skipped): an empty panel, no legend
            ax.legend(fontsize=8)
    fig.tight_layout()
    return fig
