"""prefill-job: next-token log-probabilities for every prompt of a Parquet/JSONL dataset.

Ray Data reads the input and feeds a pool of `PrefillReplica` actors (one model replica each:
an `Engine`, or a `Pipeline` with `stages > 1`); the driver streams their output batches into
one Parquet file, written atomically (`AtomicParquetWriter`). One output row per input row;
a bad row carries its reason in `error` and the job goes on. `resume=True` keeps the rows of
an earlier (interrupted) output, runs only the ids it lacks and writes the union.

An interrupted run (Ctrl-C, a failed replica) that finished some rows leaves a valid Parquet
of the rows so far at the output path (and says so on stderr): run again with `resume=True`.
Output rows are in completion order, not input order (replicas finish batches out of order).
"""
from __future__ import annotations

import sys
import time
from collections import Counter
from pathlib import Path

import ray
import ray.data

from engramflow.data.access_stats import cpus_per_actor, ensure_ray
from engramflow.data.atomic_parquet import AtomicParquetWriter
from engramflow.data.prefill_input import is_uri, prompt_format, read_prompts, resolved
from engramflow.data.prefill_replica import PrefillReplica
from engramflow.data.prefill_resume import done_ids, previous_rows
from engramflow.data.prefill_rows import error_kind
from engramflow.data.prefill_schema import output_schema
from engramflow.errors import EngramflowError


def prefill_job(checkpoint, input_path, output, *, text_column: str | None = None, ids_column: str | None = None,
                id_column: str = "id", batch_size: int = 16, concurrency: int = 1, resume: bool = False,
                top_k: int = 5, stages: int = 1, backbone: str = "reference", device: str = "cpu",
                progress: bool = True) -> dict:
    """Run the job; returns a JSON-able summary. Uses the running Ray, or starts a local one
    (and stops it afterwards). Bad arguments raise EngramflowError before any actor starts."""
    from engramflow.model.backbones import KINDS
    from engramflow.io.checkpoint import Checkpoint

    if text_column is not None and ids_column is not None:
        raise EngramflowError("give either a text column or an ids column, not both")
    for name, value in (("batch_size", batch_size), ("concurrency", concurrency), ("top_k", top_k),
                        ("stages", stages)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise EngramflowError(f"{name} must be an integer >= 1, got {value!r}")
    if backbone not in KINDS:
        raise EngramflowError(f"unknown backbone {backbone!r}; choose one of {', '.join(KINDS)}")
    if is_uri(output):
        raise EngramflowError(f"the output must be a local path (it is written atomically by rename), got {output}")
    is_ids = ids_column is not None
    column = ids_column if is_ids else (text_column or "text")
    if column == id_column:
        raise EngramflowError(f"the id column and the prompt column are both {column!r}")
    checkpoint = str(Path(checkpoint).resolve())
    cfg = Checkpoint(checkpoint).config  # a bad checkpoint fails here, not in every replica
    schema = output_schema(cfg.engram_layer_ids)
    output = Path(output)
    input_path = resolved(input_path)
    fmt = prompt_format(input_path)
    kept = previous_rows(output, schema) if resume else schema.empty_table()

    replica_kwargs = dict(checkpoint=checkpoint, column=column, is_ids=is_ids, id_column=id_column, top_k=top_k,
                          skip_ids=done_ids(kept), stages=stages, backbone=backbone, device=device)
    started = ensure_ray(num_cpus=concurrency + 1)  # one spare CPU for the read tasks
    try:
        ds, jsonl = read_prompts(input_path, fmt, column, id_column)
        results = run_replicas(ds, replica_kwargs | {"jsonl": jsonl}, concurrency, batch_size, device)
        return write_output(output, schema, kept, results, progress) | {
            "checkpoint": checkpoint, "input": input_path, "column": column, "concurrency": concurrency,
            "stages": stages}
    finally:
        if started:
            ray.shutdown()


def run_replicas(ds, replica_kwargs: dict, concurrency: int, batch_size: int, device: str):
    """The lazy Dataset of output batches from `concurrency` replicas."""
    # small blocks, so even a single input file is spread over every replica
    return ds.repartition(target_num_rows_per_block=batch_size).map_batches(
        PrefillReplica, batch_size=batch_size, batch_format="pyarrow",
        compute=ray.data.ActorPoolStrategy(size=concurrency),  # `concurrency=` is deprecated since 2.51
        num_cpus=cpus_per_actor(concurrency), num_gpus=1 if device.startswith("cuda") else 0,
        fn_constructor_kwargs=replica_kwargs)


def write_output(output: Path, schema, kept, results, progress: bool) -> dict:
    """Stream kept rows then new ones into the output; the counts of what was written."""
    from tqdm import tqdm

    errors: Counter = Counter()
    tokens = new_rows = 0
    t0 = time.perf_counter()
    with AtomicParquetWriter(output, schema) as writer, \
            tqdm(desc="prefill-job", unit="row", disable=not progress) as bar:
        writer.write(kept)
        try:
            for batch in results.iter_batches(batch_format="pyarrow", batch_size=None):
                writer.write(batch)
                writer.publish_partial = True  # from now on an interruption keeps the work done
                new_rows += batch.num_rows
                failed = batch.column("error").to_pylist()
                errors.update(error_kind(e) for e in failed if e is not None)
                tokens += sum(n for n, e in zip(batch.column("n_tokens").to_pylist(), failed) if e is None)
                bar.update(batch.num_rows)
                bar.set_postfix(failed=sum(errors.values()), tokens=tokens)
        except BaseException:
            if writer.publish_partial:
                print(f"prefill-job: stopped after {new_rows} new rows; {writer.rows} rows saved to {output}; "
                      "run again with --resume to finish", file=sys.stderr)
            raise
    seconds = time.perf_counter() - t0
    return {"out": str(output), "rows": writer.rows, "rows_kept": kept.num_rows, "rows_new": new_rows,
            "rows_failed": sum(errors.values()), "errors": dict(errors), "tokens": tokens, "seconds": seconds,
            "tokens_per_s": tokens / seconds if seconds > 0 else 0.0}
