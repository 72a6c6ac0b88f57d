"""--resume: what an earlier run of prefill-job already wrote, and what of it to keep.

The rules (the same in an uninterrupted run and in any sequence of interrupted runs finished
with --resume, so both give the same rows):

- An input row is one Parquet row, or one non-blank JSONL line (blank and whitespace-only lines
  are not rows: no output row, never counted). Every input row gets exactly one output row.
- Ids are compared as strings (the output's id column is a string): 777 and "777" are one id.
- Duplicate ids are allowed: each of those rows gets its own output row. But an output row can
  only be matched to its input row through its id, so resume keeps an earlier row only when its
  id names exactly one input row (and one earlier row); the rows of an id that several input
  rows share, and rows with no id (a JSONL line that is not an object, or has no id), are made
  again. The result equals an uninterrupted run's, row for row (output order aside: rows come
  in completion order).
"""
from __future__ import annotations

import functools
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from engramflow.data.rows import batch_ids
from engramflow.errors import EngramflowError


def previous_rows(out: Path, schema: pa.Schema) -> pa.Table:
    """The rows of an existing output that carry an id (empty when there is none)."""
    if not out.exists():
        return schema.empty_table()
    try:
        table = pq.read_table(out)
    except (OSError, pa.ArrowException) as e:
        raise EngramflowError(f"cannot read the existing output {out} to resume: {e}") from None
    if set(table.column_names) != set(schema.names):
        raise EngramflowError(f"the existing output {out} has columns {table.column_names}, expected "
                              f"{schema.names} (another checkpoint?); write to a new path instead")
    table = table.select(schema.names).cast(schema)
    return table.filter(pc.is_valid(table.column("id")))


def _ids_table(batch: pa.Table, id_column: str, jsonl: bool) -> pa.Table:
    return pa.table({"id": pa.array(batch_ids(batch, id_column, jsonl), pa.string())})


def input_id_counts(ds, id_column: str, jsonl: bool) -> Counter:
    """How many input rows carry each id (one pass over the input; ids only reach the driver)."""
    ids = ds.map_batches(functools.partial(_ids_table, id_column=id_column, jsonl=jsonl), batch_format="pyarrow",
                         batch_size=4096)
    counts: Counter = Counter()
    for batch in ids.iter_batches(batch_format="pyarrow", batch_size=None):
        counts.update(batch.column("id").to_pylist())
    counts.pop(None, None)
    return counts


def resumable_rows(kept: pa.Table, input_counts: Counter) -> pa.Table:
    """The earlier rows to keep: those whose id names one input row and one earlier row."""
    if not kept.num_rows:
        return kept
    kept_counts = Counter(kept.column("id").to_pylist())
    unique = [i for i, n in kept_counts.items() if n == 1 and input_counts.get(i, 0) <= 1]
    return kept.filter(pc.is_in(kept.column("id"), value_set=pa.array(unique, pa.string())))


def done_ids(rows: pa.Table) -> frozenset[str]:
    return frozenset(rows.column("id").to_pylist())
