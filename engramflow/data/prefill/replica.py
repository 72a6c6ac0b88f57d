"""One replica of the model for prefill-job: a callable class for `Dataset.map_batches`.

A Ray Data actor is already a Ray worker process, so the natural replica is an in-process
`Engine` held by that actor: no extra actors, no object-store hops per step, and the actor
pool size is the replica count. With `stages > 1` the replica instead holds a `Pipeline`
(its history / projection / stage actors are owned by this actor and die with it), for models
that need their blocks split over several GPUs.

Each row is its own session (open, prefill, close), so no row sees another's tokens. A batch
goes through the scheduler at depth 1 (prompts.prefill_rows): each step carries the next chunk
of as many rows as fit the prefill chunk's token budget, one forward for all of them (batched
numerics), and each row's result is still exactly its own prefill's.
"""
from __future__ import annotations

import pyarrow as pa

from engramflow.data.prefill.prompts import RowSpec, prefill_rows
from engramflow.data.prefill.schema import output_schema
from engramflow.data.rows import id_and_values
from engramflow.pipeline.config import PipelineConfig


def make_runner(model: PipelineConfig):
    if model.stages > 1:
        from engramflow.pipeline.pipeline import Pipeline

        return Pipeline.launch(model)
    from engramflow.pipeline.engine import Engine

    return Engine(model.engine)


class PrefillReplica:
    def __init__(self, model: PipelineConfig, rows: RowSpec):
        self.runner = make_runner(model)
        self.spec = rows
        self.schema = output_schema(self.runner.cfg.engram_layer_ids)

    def __call__(self, batch: pa.Table) -> pa.Table:
        s = self.spec
        rows = id_and_values(batch, s.column, s.id_column, s.jsonl)
        done = list(prefill_rows(self.runner, rows, s, self.schema, self.runner.encode))
        return pa.Table.from_pylist(done, schema=self.schema)
