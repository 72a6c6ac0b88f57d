"""The output schema of prefill-job: one row per input row.

Fixed up front (not inferred from the first batch) so batches of only failed rows, empty
batches and a resumed run's old rows all write into the same Parquet file.
"""
from __future__ import annotations

import pyarrow as pa


def wait_column(layer: int) -> str:
    return f"wait_ms_L{layer}"


def output_schema(engram_layer_ids) -> pa.Schema:
    return pa.schema([
        ("id", pa.string()),                     # the input id as a string; null when the row had none
        ("n_tokens", pa.int64()),                # prompt length; null when the row failed
        ("next_token", pa.int64()),              # greedy: argmax of the last position's logits
        ("next_logprob", pa.float32()),          # log_softmax of the fp32 logits at next_token
        ("topk_tokens", pa.list_(pa.int64())),   # highest log-probability first
        ("topk_logprobs", pa.list_(pa.float32())),
        ("prefill_ms", pa.float64()),            # wall time of the prefill steps (not tokenization)
        *[(wait_column(layer), pa.float64()) for layer in engram_layer_ids],  # summed over prefill chunks
        ("error", pa.string()),                  # null, or "<kind>: <detail>" (see prefill_rows)
    ])


def failed_row(schema: pa.Schema, rid: str | None, problem: str) -> dict:
    return dict.fromkeys(schema.names) | {"id": rid, "error": problem}
