"""Input rows of prefill-job: (id, prompt value) out of a batch, and why a value is unusable.

Every problem is a string `"<kind>: <detail>"` so the output's `error` column can be grouped
by kind (the part before the colon) and still say which value was wrong. A bad row becomes an
output row carrying its error; it never stops the job.
"""
from __future__ import annotations

import numpy as np
import pyarrow as pa

from engramflow.data.jsonl import json_objects

ERROR_KINDS = (
    "bad_json",          # a JSONL line that is not a JSON object
    "missing",           # null value, or a JSON object without the column
    "not_text",          # the text column holds something other than a string
    "not_ids",           # the ids column holds something other than a list of integers
    "empty",             # empty text / empty id list / text that tokenizes to nothing
    "ids_out_of_range",  # a token id outside [0, vocab_size)
    "too_long",          # more tokens than max_seq_len
    "rejected",          # the runner refused it (a check this module does not make)
)


def error(kind: str, detail: str) -> str:
    assert kind in ERROR_KINDS, kind
    return f"{kind}: {detail}"


def error_kind(message: str | None) -> str | None:
    return None if message is None else message.split(":", 1)[0]


def row_id(value) -> str | None:
    """Ids are written as strings, so int and str ids share one output schema; they are also
    compared as strings: 777 and "777" are the same id. (Resume re-makes the rows of an id that
    several input rows share: see prefill_resume.)"""
    return None if value is None else str(value)


def batch_ids(batch: pa.Table, id_column: str, jsonl: bool) -> list[str | None]:
    """The id of every input row of a batch, by the rules of `id_and_values` (None: no id)."""
    if not jsonl:
        return [row_id(v) for v in batch.column(id_column).to_pylist()]
    return [None if obj is None else row_id(obj.get(id_column))
            for obj, _ in json_objects(batch.column("text").to_pylist())]


def id_and_values(batch: pa.Table, column: str, id_column: str, jsonl: bool):
    """Yield (id or None, value or None, problem or None) per input row.

    `jsonl=True`: the batch's `text` column holds raw lines (from `ray.data.read_text`), parsed
    here so one malformed line fails one row instead of the whole read. Blank lines are not
    rows (no output row, in every run alike).
    """
    if not jsonl:
        ids = batch.column(id_column).to_pylist()
        for rid, value in zip(ids, batch.column(column).to_pylist()):
            yield row_id(rid), value, None
        return
    for obj, line in json_objects(batch.column("text").to_pylist()):
        if obj is None:
            yield None, None, error("bad_json", f"not a JSON object: {str(line)[:60]!r}")
            continue
        yield row_id(obj.get(id_column)), obj.get(column), None


def check_ids(value, vocab_size: int, max_seq_len: int) -> tuple[np.ndarray | None, str | None]:
    """(int64 ids, None) for a usable id list, else (None, problem)."""
    if value is None:
        return None, error("missing", "no token ids")
    if not isinstance(value, (list, tuple, np.ndarray)):
        return None, error("not_ids", f"expected a list of integers, got {type(value).__name__}")
    try:
        arr = np.asarray(value)
    except (OverflowError, ValueError):
        return None, error("not_ids", "the list does not hold plain integers")
    if arr.size == 0:
        return None, error("empty", "no token ids")
    if arr.ndim != 1 or arr.dtype.kind not in "iu":  # bools, floats, strings, None, nesting
        return None, error("not_ids", f"expected a flat list of integers, got {arr.dtype} with shape {arr.shape}")
    bad = (arr < 0) | (arr >= vocab_size)
    if bad.any():
        pos = int(np.argmax(bad))
        return None, error("ids_out_of_range",
                           f"token id {int(arr[pos])} at position {pos} is outside [0, {vocab_size})")
    return check_length(arr.astype(np.int64, copy=False), max_seq_len)


def text_problem(value) -> str | None:
    """Why a text value is unusable before tokenizing it, or None."""
    if value is None:
        return error("missing", "no text")
    if not isinstance(value, str):
        return error("not_text", f"expected a string, got {type(value).__name__}")
    return None if value else error("empty", "empty text")


def check_text(value, encode, max_seq_len: int) -> tuple[np.ndarray | None, str | None]:
    """(int64 ids of the tokenized text, None), else (None, problem)."""
    problem = text_problem(value)
    if problem:
        return None, problem
    ids = np.asarray(encode(value), dtype=np.int64)
    if ids.size == 0:
        return None, error("empty", "the text tokenizes to nothing")
    return check_length(ids, max_seq_len)


def check_length(ids: np.ndarray, max_seq_len: int) -> tuple[np.ndarray | None, str | None]:
    if ids.size > max_seq_len:
        return None, error("too_long", f"{ids.size} tokens, above max_seq_len={max_seq_len}")
    return ids, None
