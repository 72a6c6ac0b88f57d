"""The per-batch worker of access-stats: rows -> token ids -> Engram addresses -> row counts.

Each input row is its own session (open, append, close), so no n-gram spans two rows. A batch
comes back as one small table of (layer, row, count) with the rows counted by np.unique, which
the driver merges by summing. Bookkeeping travels in the same table as rows with layer = -1:
`row` is an index into STAT_NAMES and `count` the amount, so one schema carries everything.
"""
from __future__ import annotations

import sys

import numpy as np
import pyarrow as pa

from engramflow.data.jsonl import json_objects
from engramflow.data.rows import check_ids, error_kind, text_problem
from engramflow.memory.history import SessionHistory
from engramflow.io.token_map import TokenMap, load_tokenizer

STAT_LAYER = -1
SKIP_REASONS = (
    "missing",           # null value, or a JSON object without the column
    "not_text",          # the text column holds something other than a string
    "not_ids",           # the ids column holds something other than a list of integers
    "empty",             # empty text / empty id list / text that tokenizes to nothing
    "ids_out_of_range",  # a token id outside [0, vocab_size)
    "bad_json",          # a JSONL line that is not a JSON object
)
STAT_NAMES = ("rows_ok", "tokens") + tuple(f"skip:{r}" for r in SKIP_REASONS)
_STAT_INDEX = {name: i for i, name in enumerate(STAT_NAMES)}

# Long rows are hashed in pieces so one huge document cannot blow up a worker's memory.
CHUNK_TOKENS = 8192


class RowCounter:
    """Callable class for `Dataset.map_batches`: holds the tokenizer and one SessionHistory.

    `jsonl=True` means the batch's `text` column holds raw JSONL lines (from
    `ray.data.read_text`) and `column` is looked up in each parsed object; otherwise `column`
    is read straight from the batch.
    """

    def __init__(self, cfg, column: str, is_ids: bool, jsonl: bool = False, token_map_path: str | None = None,
                 tokenizer_path: str | None = None):
        self.column = column
        self.is_ids = is_ids
        self.jsonl = jsonl
        self.vocab_size = cfg.vocab_size
        # loaded here, not shipped from the driver: a path is a few bytes, the map half a megabyte
        token_map = TokenMap.load(token_map_path) if token_map_path else TokenMap.default()
        self.history = SessionHistory.from_config(cfg, token_map)
        self.n_layers = len(cfg.engram_layer_ids)
        self.tokenizer = None if is_ids else load_tokenizer(tokenizer_path)

    def __call__(self, batch: pa.Table) -> dict[str, np.ndarray]:
        stats = dict.fromkeys(STAT_NAMES, 0)
        usable = []
        for value in self._values(batch, stats):
            reason = self._problem(value)
            if reason:
                stats[f"skip:{reason}"] += 1
            else:
                usable.append(value)
        id_lists = self._to_ids(usable)
        stats["skip:empty"] += sum(1 for ids in id_lists if ids.size == 0)  # text with no tokens
        id_lists = [ids for ids in id_lists if ids.size]
        stats["rows_ok"] = len(id_lists)
        stats["tokens"] = sum(int(ids.size) for ids in id_lists)
        return self._count(id_lists, stats)

    # -- one value: usable, or the reason it is skipped --------------------------------------
    def _values(self, batch: pa.Table, stats: dict):
        if not self.jsonl:
            yield from batch.column(self.column).to_pylist()
            return
        for obj, _line in json_objects(batch.column("text").to_pylist()):
            if obj is None:
                stats["skip:bad_json"] += 1
                continue
            yield obj.get(self.column)

    def _problem(self, value) -> str | None:
        """The skip reason's kind (shared with prefill-job's row checks), or None."""
        if self.is_ids:  # no length limit here: long documents are hashed in pieces
            problem = check_ids(value, self.vocab_size, max_seq_len=sys.maxsize)[1]
        else:
            problem = text_problem(value)
        return error_kind(problem)

    def _to_ids(self, usable: list) -> list[np.ndarray]:
        if self.is_ids:
            return [np.asarray(v, dtype=np.int64) for v in usable]
        if not usable:
            return []
        return [np.asarray(e.ids, dtype=np.int64) for e in self.tokenizer.encode_batch(usable)]

    # -- ids -> addresses -> counted rows -----------------------------------------------------
    def addresses(self, ids: np.ndarray) -> np.ndarray:
        """int64 [T, n_layers, columns] of one row, hashed as its own session."""
        session = self.history.open()
        try:
            parts = [self.history.append(session, ids[i:i + CHUNK_TOKENS]) for i in range(0, ids.size, CHUNK_TOKENS)]
        finally:
            self.history.close(session)
        return np.concatenate(parts)

    def _count(self, id_lists: list[np.ndarray], stats: dict) -> dict[str, np.ndarray]:
        layers, rows, counts = [], [], []
        if id_lists:
            addr = np.concatenate([self.addresses(ids) for ids in id_lists])
            for li in range(self.n_layers):
                uniq, cnt = np.unique(addr[:, li, :], return_counts=True)
                layers.append(np.full(uniq.size, li, dtype=np.int64))
                rows.append(uniq)
                counts.append(cnt.astype(np.int64))
        names = [n for n in STAT_NAMES if stats[n]]
        layers.append(np.full(len(names), STAT_LAYER, dtype=np.int64))
        rows.append(np.array([_STAT_INDEX[n] for n in names], dtype=np.int64))
        counts.append(np.array([stats[n] for n in names], dtype=np.int64))
        return {"layer": np.concatenate(layers), "row": np.concatenate(rows), "count": np.concatenate(counts)}
