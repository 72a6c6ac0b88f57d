"""--resume: what an earlier run of prefill-job already wrote.

Rows with an id are kept and their ids skipped this time; rows without one (a JSONL line with
no id, say) cannot be matched to their input, so they are dropped and simply made again.
"""
from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from engramflow.errors import EngramflowError


def previous_rows(out: Path, schema: pa.Schema) -> pa.Table:
    """The rows of an existing output worth keeping (empty when there is none)."""
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


def done_ids(rows: pa.Table) -> frozenset[str]:
    return frozenset(rows.column("id").to_pylist())
