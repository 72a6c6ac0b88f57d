"""prefill-job's row rules: every non-blank input row gets one output row; ids are compared as
strings (777 and "777" are one id); duplicate ids are allowed; and runs interrupted and finished
with --resume give exactly the rows of one uninterrupted run."""
import json
from collections import Counter

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from engramflow.data.prefill.atomic_parquet import AtomicParquetWriter
from engramflow.data.prefill.job import prefill_job
from engramflow.data.prefill.resume import resumable_rows
from engramflow.data.rows import batch_ids, id_and_values
from engramflow.data.prefill.schema import output_schema

TOP_K = 3


def _lines():
    rows = [{"id": "dup", "ids": [5, 6, 7]},
            {"id": 777, "ids": [11, 12]},
            {"id": "a", "ids": [1, 2, 3, 4]},
            {"id": "dup", "ids": [9, 9, 9, 9, 9]},        # same id, another prompt
            {"id": "777", "ids": [13]},                    # the string form of an earlier int id
            {"id": "b", "ids": [8]},
            {"ids": [21, 22]},                             # no id
            {"id": "dup", "ids": [5, 6, 7]},               # same id, same prompt
            {"id": "c", "ids": []},                        # a failed row
            {"id": "d", "ids": [3, 1, 4, 1, 5]},
            {"id": "e", "ids": [2, 7]},
            {"ids": [21, 22]}]
    lines = [json.dumps(r) for r in rows]
    lines.insert(3, "")
    lines.insert(7, "   \t")
    lines.insert(9, "not json {")
    return lines, len(rows) + 1  # blank lines are not rows; the bad JSON line is one


def _canonical(path) -> Counter:
    """The output's rows without the timings, as a multiset (rows come in completion order)."""
    def key(r):
        r = {k: v for k, v in r.items() if k != "prefill_ms" and not k.startswith("wait_ms_")}
        return json.dumps(r, sort_keys=True)
    return Counter(key(r) for r in pq.read_table(path).to_pylist())


def _run(tiny_ckpt, src, out, resume=False):
    return prefill_job(tiny_ckpt, src, out, ids_column="ids", resume=resume, top_k=TOP_K, batch_size=3,
                       concurrency=1, progress=False)


def _interrupt_at(monkeypatch, call: int):
    """Ctrl-C as the writer is handed its `call`-th table (the first is the kept rows)."""
    real = AtomicParquetWriter.write
    calls = []

    def write(self, table):
        calls.append(1)
        if len(calls) == call:
            raise KeyboardInterrupt
        real(self, table)

    monkeypatch.setattr(AtomicParquetWriter, "write", write)


def test_rows_and_ids_rules_without_ray():
    lines, n = _lines()
    batch = pa.table({"text": lines})
    got = list(id_and_values(batch, "ids", "id", jsonl=True))
    assert len(got) == n == len(batch_ids(batch, "id", jsonl=True))
    assert [rid for rid, _, _ in got] == batch_ids(batch, "id", jsonl=True)
    assert Counter(batch_ids(batch, "id", jsonl=True))["777"] == 2
    schema = output_schema([1, 14])
    kept = pa.Table.from_pylist([dict.fromkeys(schema.names) | {"id": i} for i in ["a", "dup", "777", "x", "x"]],
                                schema=schema)
    counts = Counter({"a": 1, "dup": 3, "777": 2, "x": 1})
    # kept: only ids that name one input row and one earlier row
    assert resumable_rows(kept, counts).column("id").to_pylist() == ["a"]


@pytest.fixture(scope="module")
def uninterrupted(ray_session, tiny_ckpt, tmp_path_factory):
    """(the input file, the canonical rows of one uninterrupted run of it), run once for both
    interruption patterns below."""
    lines, n = _lines()
    src = tmp_path_factory.mktemp("jobs") / "in.jsonl"
    src.write_text("\n".join(lines) + "\n\n")
    whole = src.with_name("whole.parquet")
    summary = _run(tiny_ckpt, src, whole)
    assert summary["rows"] == n
    ids = Counter(r["id"] for r in pq.read_table(whole).to_pylist())
    assert ids["dup"] == 3 and ids["777"] == 2 and ids[None] == 3
    return src, _canonical(whole)


@pytest.mark.parametrize("stops", [[3], [3, 3]])
def test_interrupted_and_resumed_runs_equal_one_uninterrupted_run(uninterrupted, tiny_ckpt, tmp_path, monkeypatch,
                                                                  stops):
    src, want = uninterrupted
    _, n = _lines()
    out = tmp_path / "out.parquet"
    for k, stop in enumerate(stops):  # interrupted runs, the later ones resuming the earlier ones
        _interrupt_at(monkeypatch, stop)
        with pytest.raises(KeyboardInterrupt):
            _run(tiny_ckpt, src, out, resume=k > 0)
        monkeypatch.undo()
        assert 0 < pq.read_table(out).num_rows < n
    summary = _run(tiny_ckpt, src, out, resume=True)
    assert summary["rows"] == n
    assert _canonical(out) == want
