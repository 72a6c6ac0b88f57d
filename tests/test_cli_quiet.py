"""Quiet by default: each command's happy path prints at most 5 stderr lines, none of them
Ray's (its log lines and progress bars go to a log file unless --verbose), and one of them says
Ray is starting before its start-up silence. Real commands in fresh processes, real Ray:
`generate` starts a local instance of its own (the start-up users see first); the others join
the test session's instance through RAY_ADDRESS (conftest.join_env), whose start-up lines go to
the same log file the same way."""
import json
import re

import pytest

from cli_run import engramflow, stderr_lines

pytestmark = pytest.mark.slow  # a fresh process each; generate starts its own Ray (10-30 s on 2 cores)

OURS = re.compile(r"^(engramflow[ :]|prefill-job: )")  # our own lines: messages and the one progress bar


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "d.jsonl"
    rows = ["The quick brown fox jumps over the lazy dog.", "Engram memory looks rows up by n-gram hashes."] * 3
    path.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(rows)))
    return path


def check_quiet(done, max_lines=5):
    assert done.returncode == 0, done.stderr
    lines = stderr_lines(done)
    assert 1 <= len(lines) <= max_lines, done.stderr
    assert all(OURS.match(line) for line in lines), done.stderr  # nothing of Ray's
    start = next(line for line in lines if "starting" in line)
    log = re.search(r"Ray's log lines go to (\S+) ", start).group(1)
    return lines, open(log).read()


@pytest.mark.parametrize("mode", [[], ["--pipeline"]], ids=["replicas", "pipeline"])
def test_prefill_job(tiny_ckpt, dataset, tmp_path, mode, join_env):
    done = engramflow("prefill-job", "--checkpoint", tiny_ckpt, "--input", dataset, "--output",
                      tmp_path / "out.parquet", *mode, env=join_env)
    lines, log = check_quiet(done)
    bar = [line for line in lines if line.startswith("prefill-job: ")]
    assert len(bar) == 1 and "6/6" in bar[0]  # one bar, with its total
    summary = json.loads(done.stdout)
    assert summary["rows"] == 6 and 0 < summary["work_s"] < summary["wall_s"]  # the work, and the whole command
    assert "Ray" in log or "ray" in log  # Ray's lines went to the file the line names


def test_access_stats(tiny_ckpt, dataset, tmp_path, join_env):
    done = engramflow("access-stats", "--input", dataset, "--out", tmp_path / "st", "--checkpoint", tiny_ckpt,
                      "--top-k", 10, "--hit-rate-tokens", 100, "--concurrency", 1, env=join_env)
    check_quiet(done)
    summary = json.loads(done.stdout)
    assert sorted(summary["unique_rows"]) == ["1", "14"]
    assert {p.rsplit("/", 1)[1] for p in summary["wrote"]} >= {"stats.json", "coverage.png", "hit_rates.png"}


def test_generate(tiny_ckpt):
    done = engramflow("generate", "--checkpoint", tiny_ckpt, "--prompt", "The quick brown fox", "--max-new-tokens", 3)
    check_quiet(done)
    assert re.search(r"3 tokens in [\d.]+ s of generation .* start-up apart: Ray, actors and weights [\d.]+ s",
                     done.stdout)
    assert re.search(r"Engram bytes to the stages L1: [\d.]+ (B|KiB|MiB)", done.stdout)


def test_verbose_lets_ray_speak(tiny_ckpt, dataset, tmp_path, join_env):
    done = engramflow("access-stats", "--input", dataset, "--out", tmp_path / "st", "--top-k", 10,
                      "--hit-rate-tokens", 0, "--concurrency", 1, "--verbose", env=join_env)
    assert done.returncode == 0 and any(not OURS.match(line) for line in stderr_lines(done)), done.stderr
