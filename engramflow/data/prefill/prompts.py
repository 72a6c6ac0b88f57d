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


def started_row(runner, rid, value, problem, spec: RowSpec, schema, encode):
    """A row as (session, its prompt chunks), or as its finished record: None for a row already
    in the output (--resume), a failed row for a value that fails its checks."""
    if rid is not None and rid in spec.skip_ids:
        return None
    if not problem:
        ids, problem = checked_prompt(value, spec.is_ids, runner.cfg, encode)
    if problem:
        return failed_row(schema, rid, problem)
    session = runner.open()
    try:
        return session, runner.prefill_requests(session, ids, pick=Pick(logprobs=spec.top_k))
    except EngramflowError as e:  # a check of the runner's own: the row fails, the job goes on
        runner.close(session)
        return failed_row(schema, rid, error("rejected", str(e)))


def prompt_lane(runner, rows: Iterator, spec: RowSpec, schema, encode, done: list[dict]) -> Lane:
    """Rows (id, value, problem) one after another, each finished row appended to `done`."""
    layers = runner.cfg.engram_layer_ids
    for rid, value, problem in rows:
        started = started_row(runner, rid, value, problem, spec, schema, encode)
        if not isinstance(started, tuple):
            if started is not None:
                done.append(started)
            continue
        session, chunks = started
        waits: dict[int, float] = {}
        t0 = time.perf_counter()
        for chunk in chunks:
            result = yield [chunk]
            add_waits(waits, result.exposed_wait_ms)
        ms = (time.perf_counter() - t0) * 1e3  # submit of the first chunk -> the last one back
        done.append({"id": rid} | row_record(sum(c.ids.size for c in chunks), result.logits[0], ms, waits, layers))
        runner.close(session)


@dataclasses.dataclass
class _Row:
    index: int  # its place in the input: output rows keep the input's order
    rid: object
    session: str
    chunks: list
    tokens: int
    t0: float = 0.0
    waits: dict = dataclasses.field(default_factory=dict)


def packed_prompt_lane(runner, rows: Iterator, spec: RowSpec, schema, encode, done: list[dict], budget: int) -> Lane:
    """As `prompt_lane`, but each step packs the next chunk of several rows, up to `budget`
    tokens (one forward for all of them in batched numerics), admitting rows as room frees up.
    Every row still gets exactly its own prefill's result (a session's bits do not depend on
    the rows beside it); a step's exposed wait counts for each row in it. `done` gets the rows
    in input order."""
    layers, source = runner.cfg.engram_layer_ids, enumerate(rows)
    active: list[_Row] = []
    finished: dict[int, dict] = {}
    emitted, exhausted = 0, False

    def admit() -> _Row | None:
        """The next usable row as a session with its chunks; unusable rows finish at once."""
        nonlocal exhausted
        for index, (rid, value, problem) in source:
            started = started_row(runner, rid, value, problem, spec, schema, encode)
            if not isinstance(started, tuple):
                finished[index] = started  # None: already in the output (--resume)
                continue
            session, chunks = started
            return _Row(index, rid, session, chunks, sum(c.ids.size for c in chunks))
        exhausted = True
        return None

    while True:
        step, members, tokens = [], [], 0
        for row in active:
            if not step or tokens + row.chunks[0].ids.size <= budget:
                tokens += row.chunks[0].ids.size
                step.append(row.chunks.pop(0))
                members.append(row)
        while not exhausted and tokens < budget:
            row = admit()
            if row is None:
                break
            active.append(row)
            if step and tokens + row.chunks[0].ids.size > budget:
                break  # its first chunk waits for the next step
            row.t0 = time.perf_counter()
            tokens += row.chunks[0].ids.size
            step.append(row.chunks.pop(0))
            members.append(row)
        for index in sorted(finished):
            if index != emitted:
                break
            record = finished.pop(index)
            if record is not None:
                done.append(record)
            emitted += 1
        if not step:
            return
        for row in members:
            row.t0 = row.t0 or time.perf_counter()
        result = yield step
        for row, picked in zip(members, result.logits):
            add_waits(row.waits, result.exposed_wait_ms)
            if not row.chunks:
                ms = (time.perf_counter() - row.t0) * 1e3
                finished[row.index] = {"id": row.rid} | row_record(row.tokens, picked, ms, row.waits, layers)
                runner.close(row.session)
                active.remove(row)
