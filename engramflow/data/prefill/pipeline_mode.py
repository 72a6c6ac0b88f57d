"""prefill-job in pipeline mode: one Ray pipeline on the driver, many prompts in flight.

Replica mode copies the whole model into every Ray Data actor, so a model larger than one
device cannot run there. Here the driver reads the dataset and keeps `in_flight` lanes of
prompts (prompts.py: one scheduler request per prompt) moving through one `Pipeline` whose
stages split the model: while stage g prefills a chunk of one prompt, stage g+1 prefills a
chunk of another. Rows come out in input order, as in replica mode; errors stay per row.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator

import pyarrow as pa

from engramflow.data.prefill.prompts import RowSpec, prefill_rows
from engramflow.data.prefill.schema import output_schema
from engramflow.data.rows import id_and_values
from engramflow.pipeline.in_flight import check_in_flight


class PipelinePrefill:
    def __init__(self, runner, encode, spec: RowSpec, in_flight: int = 1, out_rows: int = 64):
        self.runner, self.encode, self.spec = runner, encode, spec
        self.depth = check_in_flight(in_flight)
        self.out_rows = out_rows  # rows per output table
        self.schema = output_schema(runner.cfg.engram_layer_ids)

    def run(self, batches: Iterable[pa.Table]) -> Iterator[pa.Table]:
        """Output tables (up to `out_rows` rows each) for the input batches, as rows finish."""
        s, done = self.spec, []
        rows = (row for batch in batches for row in id_and_values(batch, s.column, s.id_column, s.jsonl))
        # 2 rows per step in flight: each stage has a row's chunk to work on while the next one waits
        for record in prefill_rows(self.runner, rows, s, self.schema, self.encode, self.depth, 2 * self.depth):
            done.append(record)
            if len(done) >= self.out_rows:
                yield pa.Table.from_pylist(done, schema=self.schema)
                done = []
        if done:
            yield pa.Table.from_pylist(done, schema=self.schema)
