"""The bundled-docs dataset maker: deterministic, real text, both file formats, the CLI."""
import json

import pyarrow.parquet as pq
import pytest
from pydoc_data.topics import topics

from engramflow.cli.app import _Parser
from engramflow.cli import data as data_cli
from engramflow.data.datasets import doc_paragraphs, make_dataset, make_table
from engramflow.errors import EngramflowError
from engramflow.io.token_map import load_tokenizer


def test_deterministic_and_real_text():
    a, b = make_table(rows=200), make_table(rows=200)
    assert a.equals(b)
    assert a.num_rows == 200 and a.column_names == ["id", "text"]
    ids, texts = a.column("id").to_pylist(), a.column("text").to_pylist()
    assert len(set(ids)) == len(ids)
    for row_id, text in zip(ids, texts):
        topic = row_id.rsplit("/", 1)[0]
        assert text in topics[topic]  # verbatim from the bundled docs
        assert len(text) >= 80 and text == text.strip()


def test_rows_and_min_chars():
    every = doc_paragraphs(min_chars=0)
    long_only = doc_paragraphs(min_chars=300)
    assert len(long_only) < len(every)
    assert all(len(t) >= 300 for _, t in long_only)
    assert make_table(rows=10**9).num_rows == len(doc_paragraphs())  # capped at what exists
    assert make_table(rows=5).column("id").to_pylist() == [i for i, _ in doc_paragraphs()[:5]]


def test_bad_options():
    with pytest.raises(EngramflowError, match="rows"):
        make_table(rows=0)
    with pytest.raises(EngramflowError, match="no paragraph"):
        make_table(min_chars=10**9)
    with pytest.raises(EngramflowError, match="format"):
        make_dataset("out.csv")


def test_parquet_and_jsonl_hold_the_same_rows(tmp_path):
    pq_summary = make_dataset(tmp_path / "d.parquet", rows=30)
    js_summary = make_dataset(tmp_path / "d.data", rows=30, fmt="jsonl")
    assert pq_summary["rows"] == js_summary["rows"] == 30
    from_parquet = pq.read_table(tmp_path / "d.parquet").to_pylist()
    from_jsonl = [json.loads(line) for line in (tmp_path / "d.data").read_text().splitlines()]
    assert from_parquet == from_jsonl == make_table(rows=30).to_pylist()


def test_ids_column_is_the_tokenizer_output():
    table = make_table(rows=8, with_ids=True)
    tok = load_tokenizer()
    for text, ids in zip(table.column("text").to_pylist(), table.column("ids").to_pylist()):
        assert ids == tok.encode(text).ids and ids


def test_cli_make_dataset(tmp_path, capsys):
    parser = _Parser(prog="engramflow")
    data_cli.register(parser.add_subparsers(dest="command", parser_class=_Parser))
    args = parser.parse_args(["make-dataset", "--out", str(tmp_path / "x.jsonl"), "--rows", "7", "--with-ids"])
    assert args.func(args) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["rows"] == 7 and summary["format"] == "jsonl" and summary["columns"] == ["id", "text", "ids"]
    assert len((tmp_path / "x.jsonl").read_text().splitlines()) == 7
