"""`engramflow profile --speculative`: the workload drafts and verifies on the small V4.1 model
(the v41-small preset: the real tokenizer's vocabulary, DSpark layers); the report and summary.json carry the speculative stats, the trace has verify steps."""
import json

from engramflow.cli.app import main
from v41_golden import V41_SMALL


def test_profile_with_speculative_decoding_reports_its_stats(ray_session, v41_small_preset, tmp_path,
                                                            capsys):  # noqa: F811
    out = tmp_path / "p"
    code = main(["profile", "--checkpoint", str(v41_small_preset), "--out", str(out), "--duration", "1", "--rate", "20",
                 "--speculative", "dspark:exact:adaptive=0.5"])
    printed = capsys.readouterr().out
    assert code == 0
    spec = json.loads((out / "summary.json").read_text())["speculative"]
    assert spec["draft_tokens"] == 2 and spec["gate"] == 0.5
    assert spec["steps"] == json.loads((out / "summary.json").read_text())["decode_steps"] >= 3
    assert spec["draft_steps"] + spec["gated"] == spec["steps"] and spec["draft_steps"] >= 1
    assert spec["emitted"] == spec["steps"] + spec["accepted"] and spec["draft_s"] > 0 and spec["verify_s"] > 0
    for key in ("acceptance", "tokens_per_step"):
        assert key in spec
    assert f"{spec['tokens_per_step']:.2f} tokens per step" in printed and "speculative:" in printed
    kinds = {r["kind"] for r in json.loads((out / "overlap.json").read_text())["rows"]}
    assert kinds == {"prefill", "verify"}
    names = {e["name"] for e in json.loads((out / "trace.json").read_text())["traceEvents"]}
    assert "draft" in names


def test_profile_refuses_a_bad_speculative_option_before_ray(tmp_path, capsys):
    code = main(["profile", "--checkpoint", str(V41_SMALL), "--out", str(tmp_path / "p"), "--speculative", "dspark:q"])
    assert code == 2 and "speculative" in capsys.readouterr().err and not (tmp_path / "p").exists()
