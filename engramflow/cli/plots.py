"""The timing model's pictures: the decode-slowdown heatmap and prefill TTFT vs prompt length.

Each `*_figure` builds a matplotlib Figure (no pyplot: the caller's backend stays as it is) that
tests can inspect; `save` writes it and returns the path, which every command prints.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

SLOWDOWN_DEFINITION = "W: backbone time per token alone; T: with the Engram fetches (late K/V add their overshoot)"


def heatmap_figure(rows):
    """Slowdown T/W per storage path (rows) and base speed (columns), coloured on a log scale of
    the added time (T − W)/W, so a 2 % path and a 30x path are both readable; cells show T/W."""
    from matplotlib.colors import LogNorm
    from matplotlib.figure import Figure

    paths = list(dict.fromkeys(r.path for r in rows))
    speeds = list(dict.fromkeys(r.base_tps for r in rows))
    grid = np.array([[next(r.slowdown for r in rows if r.path == p and r.base_tps == s) for s in speeds]
                     for p in paths])
    added = grid - 1.0
    positive = added[added > 0]
    lo, hi = (positive.min(), positive.max()) if positive.size else (1e-3, 1.0)
    if hi <= lo:
        lo, hi = lo / 10, hi * 10
    fig = Figure(figsize=(3.2 + 1.0 * len(speeds), 1.8 + 0.45 * len(paths)))
    ax = fig.subplots()
    cmap = _cmap_with_under("magma_r", "white")
    im = ax.imshow(np.where(added > 0, added, lo / 10), cmap=cmap, norm=LogNorm(lo, hi), aspect="auto")
    ax.set_xticks(range(len(speeds)), [f"{s:g}" for s in speeds])
    ax.set_yticks(range(len(paths)), paths)
    ax.set_xlabel("base speed 1/W (tokens/s without Engram)")
    ax.set_ylabel("Engram storage path")
    ax.set_title(f"Decode slowdown T / W from the Engram fetch\n{SLOWDOWN_DEFINITION}", fontsize=9)
    for i in range(len(paths)):
        for j in range(len(speeds)):
            dark = added[i, j] > 0 and np.log(added[i, j] / lo) > 0.6 * np.log(hi / lo)
            ax.text(j, i, f"×{grid[i, j]:.2f}", ha="center", va="center", fontsize=8, color="white" if dark else "black")
    bar = fig.colorbar(im, ax=ax, extend="min")
    bar.set_label("added time per token (T − W) / W, log scale; white: none")
    fig.tight_layout()
    return fig


def _cmap_with_under(name: str, under: str):
    import matplotlib

    return matplotlib.colormaps[name].with_extremes(under=under)


LINE_STYLES = {("host", False): ("-", "o"), ("host", True): ("--", "s"),
               ("stage", False): (":", "^"), ("stage", True): ("-.", "D")}
COLOURS = {"host": "tab:blue", "stage": "tab:orange"}


def ttft_figure(rows, reference: tuple[int, float, str] | None = None):
    """TTFT vs prompt length: one line per placement and chunk schedule, each its own line
    style, marker and legend entry; log axes, so a reference point far above the model's lines
    (a published figure) is marked without squashing them."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.6, 4.4))
    ax = fig.subplots()
    for (pl, flag), (style, marker) in LINE_STYLES.items():
        pts = sorted((r.prompt_tokens, r.ttft_ms / 1e3) for r in rows if r.placement == pl and r.pipelined == flag)
        if pts:
            ax.plot(*zip(*pts), linestyle=style, marker=marker, ms=4, color=COLOURS[pl],
                    label=f"{pl} projection, {'chunks pipelined' if flag else 'serial chunks'}")
    if reference:
        tokens, seconds, name = reference
        ax.scatter([tokens], [seconds], color="black", marker="*", s=90, zorder=3, label=f"{name} (reference)")
        ax.annotate(f"{name}: {seconds:g} s", (tokens, seconds), textcoords="offset points", xytext=(-8, -14),
                    ha="right", fontsize=8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("prompt length (tokens, log scale)")
    ax.set_ylabel("time to first token (s, log scale)")
    ax.set_title("Prefill TTFT by Engram projection placement (model)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    return fig


def save(fig, out: str | Path) -> Path:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    return out
