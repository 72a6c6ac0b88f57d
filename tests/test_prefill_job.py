"""prefill-job against the in-process Engine: the same next token, log-probability and top-k
for every good row; bad rows carry their error; --resume completes an interrupted output."""
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from engramflow.cli.app import _Parser
from engramflow.cli import data as data_cli
from engramflow.data.prefill.atomic_parquet import AtomicParquetWriter
from engramflow.data.datasets import make_table
from engramflow.data.prefill.job import prefill_job
from engramflow.data.prefill.schema import output_schema
from engramflow.errors import EngramflowError
from engramflow.pipeline.engine import Engine

TOP_K = 4


@pytest.fixture(scope="module")
def engine(tiny_ckpt):
    return Engine(tiny_ckpt)


@pytest.fixture(scope="module")
def docs():
    return make_table(rows=8, with_ids=True).to_pylist()  # id, text, ids


_oracle_cache = {}


def oracle(engine, ids) -> dict:
    """What a plain Engine gives for one prompt (each prompt computed once per session)."""
    key = tuple(ids)
    if key not in _oracle_cache:
        _oracle_cache[key] = oracle_uncached(engine, ids)
    return _oracle_cache[key]


def oracle_uncached(engine, ids) -> dict:
    s = engine.open()
    logits = engine.prefill(s, ids)
    engine.close(s)
    logprobs = torch.log_softmax(logits, dim=-1)
    top = torch.topk(logprobs, TOP_K)
    nxt = int(torch.argmax(logits))
    return {"n_tokens": len(ids), "next_token": nxt, "next_logprob": float(logprobs[nxt]),
            "topk_tokens": top.indices.tolist(), "topk_logprobs": top.values.tolist()}


def check_row(row, want):
    assert row["error"] is None
    assert row["n_tokens"] == want["n_tokens"] and row["next_token"] == want["next_token"]
    assert row["next_logprob"] == pytest.approx(want["next_logprob"], abs=1e-5)
    assert row["topk_tokens"] == want["topk_tokens"] and row["topk_tokens"][0] == row["next_token"]
    assert row["topk_logprobs"] == pytest.approx(want["topk_logprobs"], abs=1e-5)
    assert row["prefill_ms"] > 0 and row["wait_ms_L1"] >= 0 and row["wait_ms_L14"] >= 0


def by_id(path):
    rows = pq.read_table(path).to_pylist()
    return {r["id"]: r for r in rows}, rows


def no_temp_files(directory):
    return [p.name for p in directory.iterdir() if p.name.endswith(".tmp")] == []


MODES = {"replicas": ["--concurrency", "2"], "pipeline": ["--pipeline", "--stages", "2", "--in-flight", "3"]}


@pytest.mark.parametrize("mode", list(MODES))
def test_parquet_text_via_cli_with_bad_rows(ray_session, tiny_ckpt, engine, docs, tmp_path, capsys, mode):  # noqa: F811
    bad = {"null": None, "empty": "", "long": "word " * 5000}
    ids = [d["id"] for d in docs[:4]] + list(bad) + [d["id"] for d in docs[4:]]
    texts = [d["text"] for d in docs[:4]] + list(bad.values()) + [d["text"] for d in docs[4:]]
    pq.write_table(pa.table({"id": ids, "text": texts}), tmp_path / "in.parquet")

    parser = _Parser(prog="engramflow")
    data_cli.register(parser.add_subparsers(dest="command", parser_class=_Parser))
    out = tmp_path / "out" / "next.parquet"
    args = parser.parse_args(["prefill-job", "--checkpoint", str(tiny_ckpt), "--input", str(tmp_path / "in.parquet"),
                              "--output", str(out), "--batch-size", "3", "--top-k", str(TOP_K), *MODES[mode]])
    assert args.func(args) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["mode"] == mode
    assert summary["rows"] == len(ids) and summary["errors"] == {"missing": 1, "empty": 1, "too_long": 1}

    got, rows = by_id(out)
    assert len(rows) == len(got) == len(ids)
    for d in docs:
        check_row(got[d["id"]], oracle(engine, engine.encode(d["text"])))
    assert got["long"]["error"].startswith("too_long:") and got["long"]["next_token"] is None
    assert got["null"]["error"].startswith("missing:") and got["empty"]["error"].startswith("empty:")
    assert summary["tokens"] == sum(got[d["id"]]["n_tokens"] for d in docs)
    assert no_temp_files(out.parent)


@pytest.mark.parametrize("pipeline", [False, True])
def test_jsonl_ids_bad_rows_and_resume_from_a_partial_output(ray_session, tiny_ckpt, engine, docs, tmp_path,  # noqa: F811
                                                             pipeline):
    vocab = engine.cfg.vocab_size
    bad = {"range": [5, vocab], "neg": [-1], "float": [1.5, 2], "bool": [True], "str": "1,2", "nested": [[1]],
           "empty": [], "null": None, "long": [7] * (engine.cfg.max_seq_len + 1)}
    lines = [json.dumps({"id": d["id"], "ids": d["ids"]}) for d in docs]
    lines += [json.dumps({"id": k, "ids": v}) for k, v in bad.items()]
    lines += ["not json {", json.dumps({"id": 42, "ids": [1, 2, 3]})]  # a line with no id; an int id
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")

    # an interrupted earlier run: half the good rows (marked, to see they are not made again),
    # one failed row, and a row without id (cannot be matched to its input: made again)
    schema = output_schema(engine.cfg.engram_layer_ids)
    done = docs[:4]
    marks = {"prefill_ms": -1.0, "wait_ms_L1": 0.0, "wait_ms_L14": 0.0}
    earlier = [{"id": d["id"], **oracle(engine, d["ids"]), **marks} for d in done]
    earlier += [{"id": "range", "error": "ids_out_of_range: earlier"}, {"id": None, "error": "bad_json: earlier"}]
    out = tmp_path / "next.parquet"
    pq.write_table(pa.Table.from_pylist([dict.fromkeys(schema.names) | r for r in earlier], schema=schema), out)

    summary = prefill_job(tiny_ckpt, tmp_path / "in.jsonl", out, ids_column="ids", resume=True, top_k=TOP_K,
                          concurrency=1, batch_size=4, progress=False, pipeline=pipeline)
    got, rows = by_id(out)
    assert [r["id"] for r in rows].count(None) == 1  # the bad JSON line, once
    assert sorted(r["id"] for r in rows if r["id"]) == sorted([d["id"] for d in docs] + list(bad) + ["42"])
    assert summary["rows_kept"] == 5 and summary["rows_new"] == len(rows) - 5
    for d in docs:
        check_row(got[d["id"]] | {"prefill_ms": 1.0}, oracle(engine, d["ids"]))
        assert (got[d["id"]]["prefill_ms"] == -1.0) == (d in done)
    assert got["range"]["error"] == "ids_out_of_range: earlier"  # kept, not re-run
    kinds = {k: got[k]["error"].split(":")[0] for k in bad}
    assert kinds == {"range": "ids_out_of_range", "neg": "ids_out_of_range", "float": "not_ids", "bool": "not_ids",
                     "str": "not_ids", "nested": "not_ids", "empty": "empty", "null": "missing", "long": "too_long"}
    check_row(got["42"], oracle(engine, [1, 2, 3]))
    assert no_temp_files(tmp_path)


def test_atomic_writer_keeps_the_old_file_on_failure(tmp_path):
    schema = pa.schema([("x", pa.int64())])
    out = tmp_path / "o.parquet"
    with AtomicParquetWriter(out, schema) as w:
        w.write(pa.table({"x": [1, 2]}))
    with pytest.raises(KeyboardInterrupt), AtomicParquetWriter(out, schema) as w:
        w.write(pa.table({"x": [3]}))
        raise KeyboardInterrupt
    assert pq.read_table(out).column("x").to_pylist() == [1, 2]
    assert no_temp_files(tmp_path)
    with pytest.raises(KeyboardInterrupt), AtomicParquetWriter(out, schema) as w:  # a resumable job's writer
        w.write(pa.table({"x": [4, 5]}))
        w.publish_partial = True
        raise KeyboardInterrupt
    assert pq.read_table(out).column("x").to_pylist() == [4, 5]  # a whole, valid file of what was written
    assert no_temp_files(tmp_path)


def test_user_errors(tiny_ckpt, tmp_path):
    pq.write_table(pa.table({"id": ["a"], "body": ["some text"]}), tmp_path / "in.parquet")
    with pytest.raises(EngramflowError, match="not both"):
        prefill_job(tiny_ckpt, tmp_path / "in.parquet", tmp_path / "o.parquet", text_column="a", ids_column="b")
    with pytest.raises(EngramflowError, match="top_k must be"):
        prefill_job(tiny_ckpt, tmp_path / "in.parquet", tmp_path / "o.parquet", top_k=0)
    with pytest.raises(EngramflowError, match="local path"):
        prefill_job(tiny_ckpt, tmp_path / "in.parquet", "s3://bucket/o.parquet")
    with pytest.raises(EngramflowError, match="concurrency=2 is for replica mode"):
        prefill_job(tiny_ckpt, tmp_path / "in.parquet", tmp_path / "o.parquet", pipeline=True, concurrency=2)
    with pytest.raises(EngramflowError, match="in_flight applies to pipeline mode"):
        prefill_job(tiny_ckpt, tmp_path / "in.parquet", tmp_path / "o.parquet", in_flight=2)
    with pytest.raises(EngramflowError, match=r"steps in flight must be an integer in \[1, 64\], got 0"):
        prefill_job(tiny_ckpt, tmp_path / "in.parquet", tmp_path / "o.parquet", pipeline=True, in_flight=0)
    with pytest.raises(EngramflowError, match="block_ms must be"):
        prefill_job(tiny_ckpt, tmp_path / "in.parquet", tmp_path / "o.parquet", block_ms=-1)
    with pytest.raises(EngramflowError, match="not found"):
        prefill_job(tiny_ckpt, tmp_path / "missing.jsonl", tmp_path / "o.parquet")
    (tmp_path / "o.parquet").write_text("not parquet")
    with pytest.raises(EngramflowError, match="cannot read the existing output"):
        prefill_job(tiny_ckpt, tmp_path / "in.parquet", tmp_path / "o.parquet", resume=True)


def test_user_errors_needing_ray(ray_session, tiny_ckpt, tmp_path):  # noqa: F811
    pq.write_table(pa.table({"id": ["a"], "body": ["some text"]}), tmp_path / "in.parquet")
    with pytest.raises(EngramflowError, match="'text' is not in"):
        prefill_job(tiny_ckpt, tmp_path / "in.parquet", tmp_path / "o.parquet")
    assert not (tmp_path / "o.parquet").exists()


def test_interrupted_run_keeps_its_rows_and_resume_finishes(ray_session, tiny_ckpt, engine,  # noqa: F811
                                                           docs, tmp_path, monkeypatch, capsys):
    lines = [json.dumps({"id": d["id"], "ids": d["ids"]}) for d in docs]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    out = tmp_path / "next.parquet"
    real_write = AtomicParquetWriter.write

    def interrupt_second_batch(self, table):  # Ctrl-C as the second batch of new rows arrives
        if self.rows:
            raise KeyboardInterrupt
        real_write(self, table)

    monkeypatch.setattr(AtomicParquetWriter, "write", interrupt_second_batch)
    with pytest.raises(KeyboardInterrupt):
        prefill_job(tiny_ckpt, tmp_path / "in.jsonl", out, ids_column="ids", top_k=TOP_K, batch_size=3,
                    progress=False)
    assert "--resume" in capsys.readouterr().err
    partial = pq.read_table(out).column("id").to_pylist()
    assert 0 < len(partial) < len(docs) and no_temp_files(tmp_path)

    monkeypatch.undo()
    summary = prefill_job(tiny_ckpt, tmp_path / "in.jsonl", out, ids_column="ids", resume=True, top_k=TOP_K,
                          batch_size=3, progress=False)
    got, rows = by_id(out)
    assert sorted(r["id"] for r in rows) == sorted(d["id"] for d in docs)  # each id exactly once
    assert summary["rows_kept"] == len(partial) and summary["rows_new"] == len(docs) - len(partial)
    for d in docs:
        check_row(got[d["id"]], oracle(engine, d["ids"]))
    assert no_temp_files(tmp_path)


def test_replica_lane_packs_rows_into_shared_steps(engine, docs):
    """Replica mode's rows through the scheduler: each step carries the next chunk of as many
    rows as fit the token budget (one forward for all of them), rows come out in input order,
    and each equals its own prefill; a bad row in the middle keeps its place."""
    from engramflow.data.prefill.prompts import RowSpec, prefill_rows
    from engramflow.data.prefill.schema import output_schema

    rows = [(d["id"], d["ids"], None) for d in docs]
    rows.insert(3, ("bad", [engine.cfg.vocab_size], None))
    steps = []
    submit = engine.submit
    engine.submit = lambda reqs: steps.append(len(reqs)) or submit(reqs)
    try:
        done = list(prefill_rows(engine, iter(rows), RowSpec("ids", True, "id", TOP_K),
                                 output_schema(engine.cfg.engram_layer_ids), engine.encode))
    finally:
        engine.submit = submit
    assert [r["id"] for r in done] == [r[0] for r in rows]
    assert done[3]["error"] is not None
    for d, row in zip([r for r in rows if r[0] != "bad"], [r for r in done if r["id"] != "bad"]):
        check_row(row, oracle(engine, d[1]))
    tokens = sum(len(d["ids"]) for d in docs)
    assert max(steps) > 1 and len(steps) < len(docs)  # rows shared steps
    assert len(steps) >= tokens / engine.prefill_chunk  # and no step went over the budget
