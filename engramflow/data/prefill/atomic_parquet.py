"""A Parquet file that appears whole or not at all.

Batches stream into a temp file in the output's own directory (same filesystem, so the final
`os.replace` is an atomic rename). On an exception (Ctrl-C included) the temp file is deleted
and the output path keeps what it held before -- unless `publish_partial` was set: then the
file is closed properly (a valid Parquet of the batches written so far) and renamed into
place, so a resumable job keeps its finished work. Either way no half-written file appears;
only a hard kill (SIGKILL, power loss) can leave a `.<name>.<pid>.tmp` behind.
"""
from __future__ import annotations

import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq


class AtomicParquetWriter:
    def __init__(self, path: str | Path, schema: pa.Schema):
        self.path = Path(path)
        self.schema = schema
        self.tmp = self.path.parent / f".{self.path.name}.{os.getpid()}.tmp"
        self.rows = 0
        self.publish_partial = False
        self._writer = None

    def __enter__(self) -> "AtomicParquetWriter":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._writer = pq.ParquetWriter(self.tmp, self.schema)
        return self

    def write(self, table: pa.Table) -> None:
        if table.num_rows:
            self._writer.write_table(table.select(self.schema.names).cast(self.schema))
            self.rows += table.num_rows

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            self._writer.close()
            if exc_type is None or self.publish_partial:
                os.replace(self.tmp, self.path)
        finally:
            self.tmp.unlink(missing_ok=True)  # gone already after a successful replace
