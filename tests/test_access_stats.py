"""access-stats against a direct count: the same addresses, counted with collections.Counter."""
import json
from collections import Counter

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from engramflow.cli.app import _Parser
from engramflow.cli import data as data_cli
from engramflow.data.access.stats import access_stats, count_in_process, merge_batches
from engramflow.data.access.cache_sim import hit_rate_curves
from engramflow.data.access.counts import CountMerger, coverage, decades_up_to, hot_rows, sum_by_row
from engramflow.data.datasets import make_table
from engramflow.data.access.row_counter import RowCounter
from engramflow.errors import EngramflowError
from engramflow.memory.history import SessionHistory
from engramflow.io.token_map import load_tokenizer


def direct_counts(id_lists, cfg, token_map):
    """(layer index, n-gram size or None for all columns) -> Counter of row ids."""
    history = SessionHistory.from_config(cfg, token_map)
    heads = cfg.engram_n_heads
    counts = {}
    for ids in id_lists:
        session = history.open()
        addr = history.append(session, ids)
        history.close(session)
        for li in range(len(cfg.engram_layer_ids)):
            counts.setdefault((li, None), Counter()).update(addr[:, li, :].ravel().tolist())
            for n in range(2, cfg.engram_max_ngram_size + 1):
                cols = addr[:, li, (n - 2) * heads:(n - 1) * heads]
                counts.setdefault((li, n), Counter()).update(cols.ravel().tolist())
    return counts


def check_against_direct(stats, out_dir, id_lists, cfg, token_map):
    direct = direct_counts(id_lists, cfg, token_map)
    tokens = sum(len(ids) for ids in id_lists)
    assert stats["tokens"] == tokens and stats["rows_ok"] == len(id_lists)
    for li, layer in enumerate(stats["layers"]):
        assert layer["layer_id"] == cfg.engram_layer_ids[li]
        expected = direct[(li, None)]
        assert layer["accesses"] == sum(expected.values()) == tokens * cfg.engram_columns
        assert layer["unique_rows"] == len(expected)
        for n, group in layer["by_ngram"].items():
            want = direct[(li, int(n))]
            assert group["accesses"] == sum(want.values()) == tokens * cfg.engram_n_heads
            assert group["unique_rows"] == len(want)
            check_curve(group["coverage"], want)
        check_curve(layer["coverage"], expected)
        # hot rows: (row, count), count descending then row ascending, each count exact
        hot = np.load(out_dir / layer["hot_rows_file"])
        assert hot.dtype == np.int64 and hot.shape == (min(stats["top_k"], len(expected)), 2)
        ranked = sorted(expected.items(), key=lambda rc: (-rc[1], rc[0]))
        assert hot.tolist() == [list(rc) for rc in ranked[:stats["top_k"]]]


def check_hit_rates(out_dir, id_lists, cfg, token_map, max_tokens=None):
    """hit_rates.json equals the cache simulation of the directly hashed stream, in order."""
    doc = json.loads((out_dir / "hit_rates.json").read_text())
    history = SessionHistory.from_config(cfg, token_map)
    parts, left = [], max_tokens or sum(len(ids) for ids in id_lists)
    for ids in id_lists:
        if left <= 0:
            break
        session = history.open()
        parts.append(history.append(session, ids[:left]))
        history.close(session)
        left -= len(ids[:left])
    addr = np.concatenate(parts)
    assert doc["tokens"] == addr.shape[0]
    heads = cfg.engram_n_heads
    for li, layer in enumerate(doc["layers"]):
        assert layer["all"] == hit_rate_curves(addr[:, li].reshape(-1))
        for n, c in layer["by_ngram"].items():
            assert c == hit_rate_curves(addr[:, li, (int(n) - 2) * heads:(int(n) - 1) * heads].reshape(-1))
        assert all(0 <= x <= 1 for x in layer["all"]["lru"] + layer["all"]["static"])
    assert (out_dir / "hit_rates.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def check_curve(curve, counter):
    ks = [p["k"] for p in curve]
    shares = [p["share"] for p in curve]
    assert ks == decades_up_to(len(counter))
    assert all(a <= b for a, b in zip(shares, shares[1:])) and shares[-1] == 1.0
    top = sorted(counter.values(), reverse=True)
    total = sum(top)
    assert shares == pytest.approx([sum(top[:k]) / total for k in ks], rel=1e-12)


# -- through Ray ------------------------------------------------------------------------------
def test_jsonl_text_via_cli_with_bad_rows(ray_session, tmp_path, v41_config, v4_token_map, capsys):  # noqa: F811
    texts = make_table(rows=16).column("text").to_pylist()
    bad = ['{"text": null}', '{"id": 1}', '{"text": 5}', '{"text": ["a"]}', '{"text": ""}',
           "not json {", "[1, 2]"]
    lines = [json.dumps({"id": i, "text": t}) for i, t in enumerate(texts)]
    for i, line in enumerate(bad):
        lines.insert(2 * i + 1, line)  # spread among the good rows, so several batches see some
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")

    parser = _Parser(prog="engramflow")
    data_cli.register(parser.add_subparsers(dest="command", parser_class=_Parser))
    args = parser.parse_args(["access-stats", "--input", str(tmp_path / "in.jsonl"), "--out", str(tmp_path / "o"),
                              "--top-k", "1000000", "--concurrency", "2", "--batch-size", "4"])
    assert args.func(args) == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    stats = json.loads((tmp_path / "o" / "stats.json").read_text())
    assert printed["tokens"] == stats["tokens"]
    assert stats["skipped"] == {"missing": 2, "not_text": 2, "empty": 1, "bad_json": 2}
    assert stats["rows_read"] == len(texts) + len(bad)
    tok = load_tokenizer()
    check_against_direct(stats, tmp_path / "o", [tok.encode(t).ids for t in texts], v41_config, v4_token_map)
    assert (tmp_path / "o" / "coverage.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    check_hit_rates(tmp_path / "o", [tok.encode(t).ids for t in texts], v41_config, v4_token_map)
    assert stats["hit_rates"]["tokens"] == stats["tokens"]


def test_parquet_ids_with_bad_rows_matches_in_process(ray_session, tmp_path, v41_config, v4_token_map):  # noqa: F811
    good = make_table(rows=12, with_ids=True).column("ids").to_pylist()
    vocab = v41_config.vocab_size
    bad = [None, [], [0, vocab], [-1, 5]]
    table = pa.table({"ids": pa.array(good[:6] + bad + good[6:], type=pa.list_(pa.int64()))})
    pq.write_table(table, tmp_path / "in.parquet")

    stats = access_stats(tmp_path / "in.parquet", tmp_path / "o", ids_column="ids", cfg=v41_config, top_k=5,
                         concurrency=1, batch_size=5, hit_rate_tokens=300)
    check_hit_rates(tmp_path / "o", good, v41_config, v4_token_map, max_tokens=300)
    assert stats["skipped"] == {"missing": 1, "empty": 1, "ids_out_of_range": 2}
    check_against_direct(stats, tmp_path / "o", good, v41_config, v4_token_map)

    merged, totals = count_in_process(table, v41_config, column="ids", is_ids=True, batch_size=5)
    assert totals["tokens"] == stats["tokens"] and totals["skip:ids_out_of_range"] == 2
    for li, (rows, counts) in enumerate(merged):
        hot = np.load(tmp_path / "o" / stats["layers"][li]["hot_rows_file"])
        assert np.array_equal(hot_rows(rows, counts, 5), hot)


def test_user_errors(ray_session, tmp_path, v41_config):  # noqa: F811
    pq.write_table(pa.table({"body": ["some text"]}), tmp_path / "in.parquet")
    with pytest.raises(EngramflowError, match="'text' is not in"):
        access_stats(tmp_path / "in.parquet", tmp_path / "o", cfg=v41_config)
    with pytest.raises(EngramflowError, match="not found"):
        access_stats(tmp_path / "missing.parquet", tmp_path / "o", cfg=v41_config)
    with pytest.raises(EngramflowError, match="not both"):
        access_stats(tmp_path / "in.parquet", tmp_path / "o", text_column="a", ids_column="b")
    with pytest.raises(EngramflowError, match="hit_rate_tokens must be an integer in .*, got -1"):
        access_stats(tmp_path / "in.parquet", tmp_path / "o", cfg=v41_config, hit_rate_tokens=-1)


# -- without Ray ------------------------------------------------------------------------------
def test_ids_of_the_wrong_type_are_skipped(v41_config):
    lines = ['{"ids": "1,2"}', '{"ids": [1.5]}', '{"ids": [true]}', '{"ids": [[1]]}', '{"ids": [1, null]}',
             '{"ids": 7}', '{"ids": [1, 2, 3]}', '{"ids": [99999999999999999999999]}']
    counter = RowCounter(v41_config, "ids", is_ids=True, jsonl=True)
    _, totals = merge_batches([counter(pa.table({"text": lines}))], len(v41_config.engram_layer_ids))
    assert totals["skip:not_ids"] == 7 and totals["rows_ok"] == 1 and totals["tokens"] == 3


def test_sum_by_row_and_merger_match_counter(rng):
    rows = rng.integers(0, 50, size=2000)
    counts = rng.integers(1, 5, size=2000)
    want = Counter()
    for r, c in zip(rows.tolist(), counts.tolist()):
        want[r] += c
    got_rows, got_counts = sum_by_row(rows, counts)
    assert dict(zip(got_rows.tolist(), got_counts.tolist())) == want
    assert np.all(np.diff(got_rows) > 0)
    merger = CountMerger(n_layers=1, min_fold=64)  # small, so it folds many times
    for i in range(0, 2000, 100):
        merger.add(0, rows[i:i + 100], counts[i:i + 100])
    m_rows, m_counts = merger.result()[0]
    assert np.array_equal(m_rows, got_rows) and np.array_equal(m_counts, got_counts)


def test_coverage_and_hot_rows_small_cases():
    assert coverage(np.array([], dtype=np.int64)) == []
    assert coverage(np.array([3, 1])) == [(1, 0.75), (10, 1.0)]
    assert decades_up_to(1) == [1] and decades_up_to(11) == [1, 10, 100]
    hot = hot_rows(np.array([9, 4, 7, 2]), np.array([5, 5, 1, 8]), 3)
    assert hot.tolist() == [[2, 8], [4, 5], [9, 5]]
