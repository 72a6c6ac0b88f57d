"""access-stats' hit-rate curves: a corpus read in order, its row accesses fed to simulated caches.

Counting (access_stats.py) spreads batches over Ray actors and loses their order; a cache
simulation needs the order. So the corpus is read here, in one process, in file order (rows
in order, each document's tokens in order, each position's columns in column order), up to
`max_tokens` tokens, hashed with the same RowCounter as the counts, and each layer's stream
(all 24 columns, and each n-gram size's 8) goes through cache_sim.hit_rate_curves: an LRU of N
rows and a static hot set ranked on the first half, both measured on the second half.
Outputs: `hit_rates.json` and `hit_rates.png` (one panel per layer, one line per n-gram size).
"""
from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import numpy as np
import pyarrow as pa

from engramflow.data.access.cache_sim import hit_rate_curves
from engramflow.data.access.row_counter import RowCounter
from engramflow.data.input import local_batches

HIT_RATES_JSON, HIT_RATES_PNG = "hit_rates.json", "hit_rates.png"


def ordered_addresses(path: Path, counter_kwargs: dict, jsonl: bool, max_tokens: int) -> np.ndarray:
    """int64 [T, layers, columns]: the corpus' addresses in order, its first `max_tokens` tokens."""
    counter = RowCounter(**counter_kwargs, jsonl=jsonl)
    parts, total = [], 0
    for batch in local_batches(Path(path), counter_kwargs["column"]):
        stats = defaultdict(int)  # skip counts: access-stats' counting pass reports them
        usable = [v for v in counter._values(batch, stats) if counter._problem(v) is None]
        for ids in counter._to_ids(usable):
            if not ids.size:
                continue
            ids = ids[:max_tokens - total]
            parts.append(counter.addresses(ids))
            total += ids.size
            if total >= max_tokens:
                return np.concatenate(parts)
    cols = counter_kwargs["cfg"].engram_n_heads * (counter_kwargs["cfg"].engram_max_ngram_size - 1)
    return np.concatenate(parts) if parts else np.zeros((0, counter.n_layers, cols), np.int64)


def curves(addr: np.ndarray, cfg) -> dict:
    """Per layer: the curves of all its columns and of each n-gram size's columns."""
    heads = cfg.engram_n_heads
    layers = []
    for li, layer_id in enumerate(cfg.engram_layer_ids):
        a = addr[:, li, :]
        by = {str(n): hit_rate_curves(a[:, (n - 2) * heads:(n - 1) * heads].reshape(-1))
              for n in range(2, cfg.engram_max_ngram_size + 1)}
        layers.append({"layer_id": int(layer_id), "all": hit_rate_curves(a.reshape(-1)), "by_ngram": by})
    return {"tokens": int(addr.shape[0]), "order": "file order; rows, tokens and columns in order",
            "lru": "LRU of N rows, measured on the second half of the stream after the first half",
            "static": "the top-N rows by count in the first half (ties: lower row), measured on the second half",
            "lru_whole": "LRU of N rows over the whole stream from empty", "layers": layers}


def write(out_dir: Path, doc: dict) -> None:
    tmp = Path(out_dir) / (HIT_RATES_JSON + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1))
    tmp.replace(Path(out_dir) / HIT_RATES_JSON)
    plot(Path(out_dir) / HIT_RATES_PNG, doc)


def plot(path: Path, doc: dict, title: str | None = None) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = doc["layers"]
    fig, axes = plt.subplots(1, len(layers), figsize=(6.2 * len(layers), 4.6), squeeze=False, sharey=True)
    colors = {"all": "black", "2": "tab:blue", "3": "tab:orange", "4": "tab:green"}
    for ax, layer in zip(axes[0], layers):
        series = [("all", layer["all"])] + list(layer["by_ngram"].items())
        for name, c in series:
            label = "all 24 columns" if name == "all" else f"{name}-grams (8 columns)"
            col = colors.get(name, None)
            ax.plot(c["sizes"], c["lru"], "-", color=col, label=f"LRU, {label}")
            ax.plot(c["sizes"], c["static"], "--", color=col, label=f"static top-N, {label}")
        ax.set_xscale("log")
        ax.set_xlabel("cache size N (rows)")
        ax.set_title(f"layer {layer['layer_id']}")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("hit rate (second half of the stream)")
    axes[0][-1].legend(fontsize=7, loc="upper left")
    fig.suptitle(title or f"Engram row cache hit rates, {doc['tokens']:,} tokens in order "
                          "(solid: LRU; dashed: static set ranked on the first half)", fontsize=10)
    fig.tight_layout()
    tmp = path.with_name(path.stem + ".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)
    return path
