"""One replica of the model for prefill-job: a callable class for `Dataset.map_batches`.

A Ray Data actor is already a Ray worker process, so the natural replica is an in-process
`Engine` held by that actor: no extra actors, no object-store hops per step, and the actor
pool size is the replica count. With `stages > 1` the replica instead holds a `Pipeline`
(its history / projection / stage actors are owned by this actor and die with it), for models
that need their blocks split over several GPUs.

Each row is its own session (open, prefill, close), so no row sees another's tokens.
"""
from __future__ import annotations

import time

import pyarrow as pa

from engramflow.data.prefill_rows import check_ids, check_text, error, id_and_values
from engramflow.data.prefill_schema import failed_row, output_schema, wait_column
from engramflow.errors import EngramflowError
from engramflow.model.sampling import Pick, Picked


def make_runner(checkpoint: str, stages: int, backbone: str, device: str, block_ms: float = 1.0):
    if stages > 1:
        from engramflow.pipeline.pipeline import Pipeline

        return Pipeline.launch(checkpoint, stages=stages, backbone=backbone, block_ms=block_ms)
    from engramflow.pipeline.engine import Engine

    return Engine(checkpoint, backbone=backbone, device=device, block_ms=block_ms)


def row_record(n_tokens: int, picked: Picked, prefill_ms: float, waits: dict[int, float], layers) -> dict:
    """An output row's model columns: the greedy next token, its log-probability and the top-k
    (a `Pick(logprobs=top_k)` of the last position, made on the last stage)."""
    return {"n_tokens": n_tokens, "next_token": picked.token, "next_logprob": picked.logprob,
            "topk_tokens": list(picked.top_tokens), "topk_logprobs": list(picked.top_logprobs),
            "prefill_ms": prefill_ms, **{wait_column(layer): float(waits.get(layer, 0.0)) for layer in layers},
            "error": None}


def prefill_logprobs(runner, ids, top_k: int) -> dict:
    """Prefill `ids` (already checked) in a fresh session: the next-token record of one row.
    The exposed wait is summed over the prompt's chunks."""
    session = runner.open()
    try:
        t0 = time.perf_counter()
        picked = runner.prefill(session, ids, pick=Pick(logprobs=top_k))
        prefill_ms = (time.perf_counter() - t0) * 1e3
    finally:
        runner.close(session)
    return row_record(len(ids), picked, prefill_ms, runner.prefill_waits, runner.cfg.engram_layer_ids)


def checked_prompt(value, is_ids: bool, cfg, encode):
    """(int64 ids, None) for a usable prompt value, else (None, problem)."""
    if is_ids:
        return check_ids(value, cfg.vocab_size, cfg.max_seq_len)
    return check_text(value, encode, cfg.max_seq_len)


class PrefillReplica:
    def __init__(self, checkpoint: str, column: str, is_ids: bool, id_column: str, jsonl: bool, top_k: int,
                 skip_ids=frozenset(), stages: int = 1, backbone: str = "reference", device: str = "cpu",
                 block_ms: float = 1.0):
        self.runner = make_runner(checkpoint, stages, backbone, device, block_ms)
        self.column, self.is_ids, self.id_column, self.jsonl = column, is_ids, id_column, jsonl
        self.top_k = top_k
        self.skip_ids = skip_ids
        self.schema = output_schema(self.runner.cfg.engram_layer_ids)

    def __call__(self, batch: pa.Table) -> pa.Table:
        rows = []
        for rid, value, problem in id_and_values(batch, self.column, self.id_column, self.jsonl):
            if rid is not None and rid in self.skip_ids:
                continue  # --resume: already in the output
            rows.append(failed_row(self.schema, rid, problem) if problem else self.one_row(rid, value))
        return pa.Table.from_pylist(rows, schema=self.schema)

    def one_row(self, rid: str | None, value) -> dict:
        ids, problem = checked_prompt(value, self.is_ids, self.runner.cfg, self.runner.encode)
        if problem:
            return failed_row(self.schema, rid, problem)
        try:
            return {"id": rid} | prefill_logprobs(self.runner, ids, self.top_k)
        except EngramflowError as e:  # a check of the runner's own; the row fails, the job goes on
            return failed_row(self.schema, rid, error("rejected", str(e)))
