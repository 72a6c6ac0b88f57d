"""prefill-job in pipeline mode: one Ray pipeline on the driver, many prompts in flight.

Replica mode copies the whole model into every Ray Data actor, so a model larger than one
device cannot run there. Here the driver reads the dataset and keeps `in_flight` lanes of
prompts (prompts.py: one session per prompt) moving through one `Pipeline` whose stages split
the model: while stage g prefills a chunk of one prompt, stage g+1 prefills a chunk of
another. Rows come out in completion order, as in replica mode; errors stay per row.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator

import pyarrow as pa

from engramflow.data.prefill.prompts import RowSpec, prompt_lane
from engramflow.data.prefill.schema import output_schema
from engramflow.data.rows import id_and_values
from engramflow.pipeline.in_flight import StepsInFlight


class PipelinePrefill:
    def __init__(self, runner, encode, spec: RowSpec, in_flight: int = 1, out_rows: int = 64):
        self.runner, self.encode, self.spec = runner, encode, spec
        self.flight = StepsInFlight(runner, in_flight)
        self.out_rows = out_rows  # rows per output table
        self.schema = output_schema(runner.cfg.engram_layer_ids)
        self._done: list[dict] = []

    def run(self, batches: Iterable[pa.Table]) -> Iterator[pa.Table]:
        """Output tables (up to `out_rows` rows each) for the input batches, as rows finish."""
        s = self.spec
        rows = (row for batch in batches for row in id_and_values(batch, s.column, s.id_column, s.jsonl))
        with self.runner.deferred_session_ops():  # sessions open and close all the time here
            try:
                for _ in range(self.flight.depth):  # every lane takes the next row when its prompt is done
                    self.flight.start(prompt_lane(self.runner, rows, s, self.schema, self.encode, self._done))
                while self.flight.finish_one():
                    if len(self._done) >= self.out_rows:
                        yield self._table()
            except BaseException:
                self.flight.abandon()
                raise
        if self._done:
            yield self._table()

    def _table(self) -> pa.Table:
        rows = list(self._done)
        self._done.clear()  # in place: every lane appends to this list
        return pa.Table.from_pylist(rows, schema=self.schema)
