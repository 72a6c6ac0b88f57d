"""The row driver both prefill modes share, and the typed options a job's rows need (the
model's are a PipelineConfig: pipeline/config.py).

`prefill_rows` makes each usable input row one prefill-only request to the scheduler
(scheduling/): a row whose id is already in the output (--resume) is skipped, a row whose value
fails its checks becomes an error row at once, and a usable row gets its own session, prefilled
chunk by chunk beside other rows' chunks (every row equals what `Engine.prefill` gives for
it); the last chunk asks the last stage for a `Pick` (token, log-prob, top-k), not the
vocabulary. Replica mode runs it per batch at depth 1 on the replica's Engine; pipeline mode
keeps `in_flight` steps going through one Pipeline.
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator

from engramflow.data.prefill.schema import failed_row, wait_column
from engramflow.data.rows import check_ids, check_text, error
from engramflow.errors import EngramflowError
from engramflow.model.sampling import Pick, Picked
from engramflow.scheduling import Request, Scheduler
from engramflow.scheduling.prefix_reuse import default_budget_bytes


@dataclasses.dataclass(frozen=True)
class RowSpec:
    """Where a row's prompt and id are, and what to record for it."""
    column: str  # the prompt: text, or a list of token ids when is_ids
    is_ids: bool
    id_column: str
    top_k: int
    jsonl: bool = False  # rows are raw JSONL lines, parsed per row
    skip_ids: frozenset = frozenset()  # ids already in the output (--resume)
    share_prefix: bool = False  # rows sharing a prefix (an instruction, few-shot examples) prefill it once


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


class RowSink:
    """One row's request to the scheduler: its record when its first token is picked (a
    `Pick(logprobs=top_k)` of the prompt's last position), or its error row."""

    def __init__(self, rid, n_tokens: int, schema, layers, finished: dict, index: int):
        self.rid, self.n_tokens, self.schema, self.layers = rid, n_tokens, schema, layers
        self.finished, self.index = finished, index
        self.request: Request | None = None

    def on_token(self, picked: Picked) -> str:
        ms = (time.perf_counter() - self.request.admitted_at) * 1e3  # its first chunk -> its last one back
        self.finished[self.index] = {"id": self.rid} | row_record(self.n_tokens, picked, ms, self.request.waits,
                                                                 self.layers)
        return "length"

    def on_finish(self, reason: str) -> None:
        pass

    def on_error(self, message: str) -> None:  # a check of the runner's own: the row fails, the job goes on
        self.finished[self.index] = failed_row(self.schema, self.rid, error("rejected", message))


def prefill_rows(runner, rows: Iterator, spec: RowSpec, schema, encode, depth: int = 1,
                 max_rows: int = 8) -> Iterator[dict]:
    """Each usable row (id, value, problem) as one request to the scheduler, prefill only:
    up to `max_rows` rows open at once, `depth` steps in flight, and each step packs the next
    chunk of several rows up to the prefill chunk's token budget (one forward for all of them in
    batched numerics; every row still gets exactly its own prefill's result, a session's bits
    not depending on its company). A row whose id is already in the output (--resume) is
    skipped, a row whose value fails its checks becomes an error row at once. Records come out
    in input order as they finish."""
    layers, source = runner.cfg.engram_layer_ids, enumerate(rows)
    finished: dict[int, dict | None] = {}
    # --share-prefix: a finished row's session is kept (scheduling/prefix_reuse.py) and a later
    # row forks it at the prefix they share; bit-identical in the default (batched) numerics
    budget = default_budget_bytes(runner.cached_token_bytes(), runner.cfg.max_seq_len) if spec.share_prefix else 0
    scheduler = Scheduler(runner, max_sessions=max_rows, max_queue=0, depth=depth, prefix_cache_bytes=budget)
    exhausted = False

    def feed() -> None:
        nonlocal exhausted
        while not exhausted and scheduler.load < max_rows:
            index, (rid, value, problem) = next(source, (None, (None, None, None)))
            if index is None:
                exhausted = True
            elif rid is not None and rid in spec.skip_ids:
                finished[index] = None
            else:
                ids, problem = (None, problem) if problem else checked_prompt(value, spec.is_ids, runner.cfg, encode)
                if problem:
                    finished[index] = failed_row(schema, rid, problem)
                    continue
                sink = RowSink(rid, int(ids.size), schema, layers, finished, index)
                sink.request = scheduler.add(Request(ids, lambda step: Pick(logprobs=spec.top_k), sink, max_tokens=1))

    emitted = 0

    def ready() -> Iterator[dict]:
        nonlocal emitted
        while emitted in finished:
            record = finished.pop(emitted)
            emitted += 1
            if record is not None:
                yield record

    try:
        for _ in scheduler.stepping(feed):
            if scheduler.gave_up is not None:  # the runner's recovery gave up: the job cannot go on
                raise EngramflowError(scheduler.gave_up)
            yield from ready()
        yield from ready()
    finally:
        scheduler.prefix.clear()  # --share-prefix: the rows' kept sessions end with the rows
