"""The prompt-chunk driver both prefill modes share, and the typed options a job's rows need.

`prompt_lane` takes input rows one after another: a row whose id is already in the output
(--resume) is skipped, a row whose value fails its checks becomes an error row at once, and a
usable row gets its own session and is prefilled chunk by chunk (one single-session step per
chunk, so every row equals what `Engine.prefill` gives for it); the last chunk asks the last
stage for a `Pick` (token, log-prob, top-k), not the vocabulary. It is a lane for
StepsInFlight (pipeline/in_flight.py): replica mode runs one lane per batch at depth 1,
pipeline mode keeps `in_flight` lanes going through one Pipeline.
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator

from engramflow.data.prefill.schema import failed_row, wait_column
from engramflow.data.rows import check_ids, check_text, error
from engramflow.errors import EngramflowError
from engramflow.model.sampling import Pick, Picked
from engramflow.pipeline.in_flight import Lane
from engramflow.pipeline.runner import add_waits


@dataclasses.dataclass(frozen=True)
class RowSpec:
    """Where a row's prompt and id are, and what to record for it."""
    column: str  # the prompt: text, or a list of token ids when is_ids
    is_ids: bool
    id_column: str
    top_k: int
    jsonl: bool = False  # rows are raw JSONL lines, parsed per row
    skip_ids: frozenset = frozenset()  # ids already in the output (--resume)


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """The model a replica (or the job's pipeline) runs."""
    checkpoint: str
    stages: int = 1
    backbone: str = "reference"
    device: str = "cpu"
    block_ms: float = 1.0


def row_record(n_tokens: int, picked: Picked, prefill_ms: float, waits: dict[int, float], layers) -> dict:
    """An output row's model columns: the greedy next token, its log-probability and the top-k
    (a `Pick(logprobs=top_k)` of the last position, made on the last stage)."""
    return {"n_tokens": n_tokens, "next_token": picked.token, "next_logprob": picked.logprob,
            "topk_tokens": list(picked.top_tokens), "topk_logprobs": list(picked.top_logprobs),
            "prefill_ms": prefill_ms, **{wait_column(layer): float(waits.get(layer, 0.0)) for layer in layers},
            "error": None}


def checked_prompt(value, is_ids: bool, cfg, encode):
    """(int64 ids, None) for a usable prompt value, else (None, problem)."""
    if is_ids:
        return check_ids(value, cfg.vocab_size, cfg.max_seq_len)
    return check_text(value, encode, cfg.max_seq_len)


def prompt_lane(runner, rows: Iterator, spec: RowSpec, schema, encode, done: list[dict]) -> Lane:
    """Rows (id, value, problem) one after another, each finished row appended to `done`."""
    layers = runner.cfg.engram_layer_ids
    for rid, value, problem in rows:
        if rid is not None and rid in spec.skip_ids:
            continue  # --resume: already in the output
        if not problem:
            ids, problem = checked_prompt(value, spec.is_ids, runner.cfg, encode)
        if problem:
            done.append(failed_row(schema, rid, problem))
            continue
        session = runner.open()
        try:
            chunks = runner.prefill_requests(session, ids, pick=Pick(logprobs=spec.top_k))
        except EngramflowError as e:  # a check of the runner's own: the row fails, the job goes on
            runner.close(session)
            done.append(failed_row(schema, rid, error("rejected", str(e))))
            continue
        waits: dict[int, float] = {}
        t0 = time.perf_counter()
        for chunk in chunks:
            result = yield [chunk]
            add_waits(waits, result.exposed_wait_ms)
        ms = (time.perf_counter() - t0) * 1e3  # submit of the first chunk -> the last one back
        done.append({"id": rid} | row_record(sum(c.ids.size for c in chunks), result.logits[0], ms, waits, layers))
        runner.close(session)
