"""A small real-text dataset that needs no download: Python's own bundled documentation.

`pydoc_data.topics.topics` (topic -> text, shipped with CPython for `help()`) is split into
paragraphs at blank lines. Topics are taken in sorted order and paragraphs in text order, so
the output is deterministic for a given Python version (the text changes between versions;
the summary records which one made it).

Columns: `id` (string "topic/paragraph-index"), `text`, and optionally `ids` (list<int64>,
the V4 tokenizer's token ids of `text`).
"""
from __future__ import annotations

import json
import platform
import re
from pathlib import Path

import pyarrow as pa

from engramflow.errors import EngramflowError

FORMATS = ("parquet", "jsonl")
_BLANK_LINE = re.compile(r"\n[ \t]*\n")


def doc_paragraphs(min_chars: int = 80) -> list[tuple[str, str]]:
    """(id, text) for every paragraph of at least `min_chars` characters, in a fixed order."""
    from pydoc_data.topics import topics

    out = []
    for topic in sorted(topics):
        for i, para in enumerate(_BLANK_LINE.split(topics[topic])):
            para = para.strip()
            if len(para) >= min_chars:  # headings and one-line fragments carry little n-gram signal
                out.append((f"{topic}/{i}", para))
    return out


def make_table(rows: int | None = None, min_chars: int = 80, with_ids: bool = False,
               tokenizer_path: str | None = None) -> pa.Table:
    """The first `rows` paragraphs (all when None; capped at what the docs hold)."""
    if rows is not None and rows < 1:
        raise EngramflowError(f"rows must be >= 1, got {rows}")
    if min_chars < 0:
        raise EngramflowError(f"min_chars must be >= 0, got {min_chars}")
    paras = doc_paragraphs(min_chars)[:rows]
    if not paras:
        raise EngramflowError(f"no paragraph of the bundled docs has >= {min_chars} characters")
    columns = {"id": [p[0] for p in paras], "text": [p[1] for p in paras]}
    if with_ids:
        from engramflow.io.token_map import load_tokenizer

        tok = load_tokenizer(tokenizer_path)
        columns["ids"] = pa.array([e.ids for e in tok.encode_batch(columns["text"])], type=pa.list_(pa.int64()))
    return pa.table(columns)


def format_of(path: str | Path, fmt: str | None = None) -> str:
    """The explicit format, else the one the file suffix names."""
    if fmt is None:
        suffix = Path(path).suffix.lower()
        fmt = {".parquet": "parquet", ".jsonl": "jsonl", ".json": "jsonl"}.get(suffix)
        if fmt is None:
            raise EngramflowError(f"cannot tell the format of {path} from its suffix; pass parquet or jsonl")
    if fmt not in FORMATS:
        raise EngramflowError(f"unknown dataset format {fmt!r}; known: {', '.join(FORMATS)}")
    return fmt


def write_table(table: pa.Table, path: str | Path, fmt: str | None = None) -> Path:
    path = Path(path)
    fmt = format_of(path, fmt)
    path.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "parquet":
        import pyarrow.parquet as pq

        pq.write_table(table, path)
    else:
        with path.open("w", encoding="utf-8") as f:
            for row in table.to_pylist():
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return path


def make_dataset(out: str | Path, rows: int | None = None, fmt: str | None = None, min_chars: int = 80,
                 with_ids: bool = False, tokenizer_path: str | None = None) -> dict:
    """Write the dataset; returns a JSON-able summary."""
    fmt = format_of(out, fmt)  # fail on a bad format before doing any work
    table = make_table(rows, min_chars, with_ids, tokenizer_path)
    path = write_table(table, out, fmt)
    return {"out": str(path), "format": fmt, "rows": table.num_rows, "columns": table.column_names,
            "chars": sum(len(t) for t in table.column("text").to_pylist()),
            "source": f"pydoc_data.topics (Python {platform.python_version()})"}
