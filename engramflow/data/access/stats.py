"""access-stats: which Engram table rows a corpus touches, and how concentrated the accesses are.

Tokenizer + history + hashing only: no tables, no backbone. Rows are spread over a pool of Ray
Data actors (`RowCounter`), each returning per-batch (layer, row, count) triples that the driver
merges by summing (`CountMerger`). Outputs land in `out_dir` (formats: see `report`).
"""
from __future__ import annotations


import time
from collections import Counter
from pathlib import Path

import ray
import ray.data

from engramflow.data.access import hit_rates, report
from engramflow.data.access.counts import CountMerger
from engramflow.data.access.row_counter import SKIP_REASONS, STAT_LAYER, STAT_NAMES, RowCounter
from engramflow.data.input import input_format, read_input
from engramflow.errors import EngramflowError
from engramflow.validate import check_int
from engramflow.pipeline.ray_address import ensure_ray


def access_stats(input_path, out_dir, *, text_column: str | None = None, ids_column: str | None = None,
                 cfg=None, top_k: int = 100_000, concurrency: int = 2, batch_size: int = 64,
                 token_map_path: str | None = None, tokenizer_path: str | None = None,
                 hit_rate_tokens: int = 250_000) -> dict:
    """Count the Engram row accesses of a Parquet/JSONL corpus, write the outputs, return stats.json.

    Text is read from `text_column` (default "text") unless `ids_column` names token-id lists.
    `hit_rate_tokens`: simulate caches over the corpus' first this many tokens, in order
    (hit_rates.py: `hit_rates.json`, `hit_rates.png`); 0 skips the simulation.
    Uses the running Ray instance, or starts a local one (and stops it afterwards).
    """
    from engramflow.io.layout import build_layout
    from engramflow.io.token_map import TokenMap, load_tokenizer
    from engramflow.io.presets import preset

    if text_column is not None and ids_column is not None:
        raise EngramflowError("give either a text column or an ids column, not both")
    if top_k < 1 or concurrency < 1 or batch_size < 1:
        raise EngramflowError(
            f"top_k, concurrency and batch_size must be >= 1 (got {top_k}, {concurrency}, {batch_size})")
    check_int("hit_rate_tokens", hit_rate_tokens, 0, 10**8)
    is_ids = ids_column is not None
    column = ids_column if is_ids else (text_column or "text")
    cfg = cfg or preset("deepseek-v4.1-flash")
    # absolute paths: the Ray workers need not share the driver's working directory
    input_path, out_dir = Path(input_path).resolve(), Path(out_dir)
    token_map_path = str(Path(token_map_path).resolve()) if token_map_path else None
    tokenizer_path = str(Path(tokenizer_path).resolve()) if tokenizer_path else None
    # load once here so a bad token map or tokenizer fails before Ray starts; workers load their own
    (TokenMap.load(token_map_path) if token_map_path else TokenMap.default()).check(
        cfg.vocab_size, cfg.engram_compressed_vocab_size)
    if not is_ids:
        load_tokenizer(tokenizer_path)

    counter_kwargs = dict(cfg=cfg, column=column, is_ids=is_ids, token_map_path=token_map_path,
                          tokenizer_path=tokenizer_path)
    t0 = time.perf_counter()
    merged, totals = count_with_ray(input_path, counter_kwargs, concurrency, batch_size)
    seconds = time.perf_counter() - t0

    layout = build_layout(cfg)
    out_dir.mkdir(parents=True, exist_ok=True)
    stats = {
        "input": str(input_path), "column": column, "column_kind": "ids" if is_ids else "text",
        "layer_ids": list(cfg.engram_layer_ids), "max_ngram": layout.max_ngram, "n_heads": layout.n_heads,
        "rows_read": totals["rows_ok"] + sum(totals[f"skip:{r}"] for r in SKIP_REASONS),
        "rows_ok": totals["rows_ok"], "tokens": totals["tokens"],
        "skipped": {r: totals[f"skip:{r}"] for r in SKIP_REASONS if totals[f"skip:{r}"]},
        "seconds": seconds, "tokens_per_s": totals["tokens"] / seconds, "concurrency": concurrency,
        "top_k": top_k, "hot_rows_format": report.HOT_ROWS_FORMAT,
        "layers": [report.layer_stats(layout, li, rows, counts) for li, (rows, counts) in enumerate(merged)],
    }
    report.write_hot_rows(out_dir, layout, merged, top_k)
    report.plot_coverage(out_dir / "coverage.png", layout, merged)
    if hit_rate_tokens:
        t1 = time.perf_counter()
        addr = hit_rates.ordered_addresses(input_path, counter_kwargs, input_format(input_path) == "jsonl",
                                           hit_rate_tokens)
        doc = hit_rates.curves(addr, cfg)
        hit_rates.write(out_dir, doc)
        stats["hit_rates"] = {"file": hit_rates.HIT_RATES_JSON, "plot": hit_rates.HIT_RATES_PNG,
                              "tokens": doc["tokens"], "seconds": time.perf_counter() - t1}
    report.write_stats(out_dir, stats)
    return stats


def count_with_ray(input_path: Path, counter_kwargs: dict, concurrency: int, batch_size: int):
    """(per-layer merged counts, totals) from a pool of `concurrency` RowCounter actors."""
    started = ensure_ray(num_cpus=concurrency + 1)  # one spare CPU for the read tasks
    try:
        ds, jsonl = read_input(input_path, [counter_kwargs["column"]])
        # small blocks, so even a single input file is spread over every actor
        counted = ds.repartition(target_num_rows_per_block=batch_size).map_batches(
            RowCounter, batch_size=batch_size, batch_format="pyarrow",
            compute=ray.data.ActorPoolStrategy(size=concurrency),  # `concurrency=` is deprecated since 2.51
            num_cpus=cpus_per_actor(concurrency), fn_constructor_kwargs=counter_kwargs | {"jsonl": jsonl})
        n_layers = len(counter_kwargs["cfg"].engram_layer_ids)
        return merge_batches(counted.iter_batches(batch_format="numpy", batch_size=None), n_layers)
    finally:
        if started:
            ray.shutdown()


def count_in_process(table, cfg, column: str = "text", is_ids: bool = False, batch_size: int = 64,
                     token_map_path: str | None = None, tokenizer_path: str | None = None) -> tuple[list, Counter]:
    """The same counting in this process, without Ray: the single-process baseline."""
    counter = RowCounter(cfg, column, is_ids, token_map_path=token_map_path, tokenizer_path=tokenizer_path)
    batches = (counter(b) for b in table.to_batches(max_chunksize=batch_size))
    return merge_batches(batches, len(cfg.engram_layer_ids))


def merge_batches(batches, n_layers: int) -> tuple[list, Counter]:
    """Fold RowCounter outputs: per layer (rows ascending, counts), plus the bookkeeping totals."""
    merger = CountMerger(n_layers)
    totals: Counter = Counter(dict.fromkeys(STAT_NAMES, 0))
    for batch in batches:
        layer, row, count = batch["layer"], batch["row"], batch["count"]
        meta = layer == STAT_LAYER
        for name_index, amount in zip(row[meta].tolist(), count[meta].tolist()):
            totals[STAT_NAMES[name_index]] += amount
        for li in range(n_layers):
            mine = layer == li
            if mine.any():
                merger.add(li, row[mine], count[mine])
    return merger.result(), totals


# -- Ray plumbing ------------------------------------------------------------------------------
def cpus_per_actor(concurrency: int) -> float:
    """CPUs to request per counting actor so that one CPU stays free for the read tasks.

    Without it, N actors on an N-CPU Ray hold every CPU, the reads are never scheduled and the
    pipeline waits forever; sharing the remaining CPUs keeps the requested number of actors.
    """
    spare = max(ray.cluster_resources().get("CPU", 1.0) - 1.0, 0.0)
    return min(1.0, spare / concurrency)
