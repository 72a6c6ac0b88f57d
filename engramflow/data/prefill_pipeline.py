"""prefill-job in pipeline mode: one Ray pipeline on the driver, many prompts in flight.

Replica mode copies the whole model into every Ray Data actor, so a model larger than one
device cannot run there. Here the driver reads the dataset, and keeps `in_flight` prompts
(one session each) moving through one `Pipeline` whose stages split the model: while stage g
prefills a chunk of one prompt, stage g+1 prefills a chunk of another. Each prompt's chunks
are single-session steps, so every row equals what `Engine.prefill` gives for it; the
last chunk asks the last stage for a `Pick` (token, log-prob, top-k), not the vocabulary.

Rows come out in completion order, as in replica mode; errors stay per row.
"""
from __future__ import annotations

import time
from collections.abc import Iterable, Iterator

import pyarrow as pa

from engramflow.data.prefill_replica import checked_prompt, row_record
from engramflow.data.prefill_rows import error, id_and_values
from engramflow.data.prefill_schema import failed_row, output_schema
from engramflow.errors import EngramflowError
from engramflow.model.sampling import Pick
from engramflow.pipeline.in_flight import Lane, StepsInFlight
from engramflow.pipeline.runner import add_waits


class PipelinePrefill:
    def __init__(self, runner, encode, *, column: str, is_ids: bool, id_column: str, jsonl: bool, top_k: int,
                 skip_ids=frozenset(), in_flight: int = 1, out_rows: int = 64):
        self.runner, self.encode = runner, encode
        self.column, self.is_ids, self.id_column, self.jsonl = column, is_ids, id_column, jsonl
        self.top_k, self.skip_ids = top_k, skip_ids
        self.flight = StepsInFlight(runner, in_flight)
        self.out_rows = out_rows  # rows per output table
        self.schema = output_schema(runner.cfg.engram_layer_ids)
        self._done: list[dict] = []
        self._rows: Iterator = iter(())

    def run(self, batches: Iterable[pa.Table]) -> Iterator[pa.Table]:
        """Output tables (up to `out_rows` rows each) for the input batches, as rows finish."""
        self._rows = (row for batch in batches for row in id_and_values(batch, self.column, self.id_column, self.jsonl))
        with self.runner.deferred_session_ops():  # sessions open and close all the time here
            try:
                for _ in range(self.flight.depth):  # one prompt per lane; each lane moves on to the next row
                    self.flight.start(self._lane())
                while self.flight.finish_one():
                    if len(self._done) >= self.out_rows:
                        yield self._table()
            except BaseException:
                self.flight.abandon()
                raise
        if self._done:
            yield self._table()

    def _table(self) -> pa.Table:
        rows, self._done = self._done, []
        return pa.Table.from_pylist(rows, schema=self.schema)

    def _lane(self) -> Lane:
        """Rows one after another: each usable row's prompt chunk by chunk in its own session
        (rows that fail their checks are written at once and the lane moves on)."""
        for rid, value, problem in self._rows:
            if rid is not None and rid in self.skip_ids:
                continue  # --resume: already in the output
            if not problem:
                ids, problem = checked_prompt(value, self.is_ids, self.runner.cfg, self.encode)
            if problem:
                self._done.append(failed_row(self.schema, rid, problem))
                continue
            session = self.runner.open()
            try:
                chunks = self.runner.prefill_requests(session, ids, pick=Pick(logprobs=self.top_k))
            except EngramflowError as e:  # a check of the runner's own: the row fails, the job goes on
                self.runner.close(session)
                self._done.append(failed_row(self.schema, rid, error("rejected", str(e))))
                continue
            waits: dict[int, float] = {}
            t0 = time.perf_counter()
            for chunk in chunks:
                result = yield [chunk]
                add_waits(waits, result.exposed_wait_ms)
            ms = (time.perf_counter() - t0) * 1e3  # submit of the first chunk -> the last one back
            self._done.append({"id": rid} | row_record(sum(c.ids.size for c in chunks), result.logits[0], ms, waits,
                                                       self.runner.cfg.engram_layer_ids))
            self.runner.close(session)
