import json

import pytest

from engramflow.cli.app import main
from engramflow.errors import EngramflowError
from engramflow.profiling.timing_model import PATHS_MS, predict, step_ms


@pytest.mark.parametrize("base_tps,f0,f1,expect_ms", [
    (100, 0.0, 0.0, 10.0),      # W = 10 ms, nothing late
    (100, 0.25, 3.25, 10.0),    # exactly at the windows W/40 = 0.25, 13W/40 = 3.25
    (100, 1.0, 5.0, 12.5),      # 0.75 + 1.75 overshoot
    (600, 1.5, 1.5, 1000 / 600 + (1.5 - 1000 / 600 / 40) + (1.5 - 13 * 1000 / 600 / 40)),
    (25, 30.0, 30.0, 40 + (30 - 1) + (30 - 13)),
])
def test_hand_computed_cases(base_tps, f0, f1, expect_ms):
    p = predict(base_tps, f0, f1)
    assert p.tokens_per_s == pytest.approx(1000 / expect_ms, rel=1e-12)
    assert p.slowdown == pytest.approx(expect_ms / (1000 / base_tps), rel=1e-12)
    assert step_ms(1000 / base_tps, f0, f1) == pytest.approx(expect_ms, rel=1e-12)


def test_a_late_table_costs_only_its_overshoot():
    base = predict(100, 0, 0).tokens_per_s
    assert predict(100, 0.2, 3.0).tokens_per_s == base
    assert predict(100, 0.0, 4.25).tokens_per_s == pytest.approx(1000 / 11)


def test_cli_json_rows(capsys):
    assert main(["timing-model", "--base-tps", "100,600", "--path", "internal-ssd,wifi", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [(r["path"], r["base_tps"]) for r in rows] == [("internal-ssd", 100), ("internal-ssd", 600), ("wifi", 100), ("wifi", 600)]
    for r in rows:
        assert r["f0_ms"] == r["f1_ms"] == PATHS_MS[r["path"]]
        assert r["tokens_per_s"] == pytest.approx(predict(r["base_tps"], r["f0_ms"], r["f1_ms"]).tokens_per_s)
    assert main(["timing-model", "--base-tps", "100", "--f0-ms", "1", "--f1-ms", "5", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)["rows"]
    assert row == {"base_tps": 100.0, "path": "custom", "f0_ms": 1.0, "f1_ms": 5.0,
                   "tokens_per_s": pytest.approx(80.0), "slowdown": pytest.approx(1.25)}


def test_heatmap_png(tmp_path, capsys):
    out = tmp_path / "heat.png"
    assert main(["timing-model", "--heatmap", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("argv,match", [
    (["--path", "floppy"], "unknown storage path 'floppy'"),
    (["--base-tps", "fast"], "--base-tps must be comma-separated numbers"),
    (["--base-tps", "0"], "must be a finite positive number"),
    (["--f0-ms", "1"], "--f0-ms and --f1-ms go together"),
])
def test_bad_input_exits_2(capsys, argv, match):
    assert main(["timing-model", *argv]) == 2
    assert match in capsys.readouterr().err


def test_predict_rejects_negative_times():
    with pytest.raises(EngramflowError, match="f1_ms"):
        predict(100, 0, -1)


def test_chained_model_counts_an_l1_stall_once():
    # W = 10 ms: an L1 stall of 0.75 ms also pushes block 14 back by 0.75 ms
    assert step_ms(10, 1.0, 5.0, chained=True) == pytest.approx(10 + 0.75 + (5 - 3.25 - 0.75))
    assert step_ms(10, 1.0, 3.5, chained=True) == pytest.approx(10.75)  # L14 hidden by the L1 stall
    assert step_ms(10, 0.2, 5.0, chained=True) == step_ms(10, 0.2, 5.0)  # one late table: same as the plain model
