"""`engramflow serve`'s own checks: one line, exit 2, before Ray starts."""
import pytest

from engramflow.cli.app import main


def _run(capsys, argv):
    code = main(argv)
    err = capsys.readouterr().err.strip()
    return code, err


def test_missing_checkpoint(capsys, tmp_path):
    code, err = _run(capsys, ["serve", "--checkpoint", str(tmp_path / "nope")])
    assert code == 2 and err.startswith("engramflow serve: error:") and "nope" in err and "\n" not in err


@pytest.mark.parametrize("flag, value", [("--port", "70000"), ("--replicas", "0"), ("--max-sessions", "0"),
                                         ("--max-queue", "-1"), ("--stages", "0")])
def test_bad_numbers(capsys, tiny_ckpt, flag, value):
    code, err = _run(capsys, ["serve", "--checkpoint", str(tiny_ckpt), flag, value])
    assert code == 2 and flag in err and "\n" not in err


def test_key_file_follows_the_secret_rules(capsys, tiny_ckpt, tmp_path):
    key = tmp_path / "key"
    key.write_text("k" * 32)
    key.chmod(0o644)
    code, err = _run(capsys, ["serve", "--checkpoint", str(tiny_ckpt), "--api-key-file", str(key)])
    assert code == 2 and "chmod 600" in err
    key.chmod(0o600)
    key.write_text("short")
    code, err = _run(capsys, ["serve", "--checkpoint", str(tiny_ckpt), "--api-key-file", str(key)])
    assert code == 2 and "secret file" in err


@pytest.mark.parametrize("spec, words", [("dspark:x", "speculative"), ("dspark:3", "block of 2")])
def test_speculative_option_is_checked_before_ray(capsys, spec, words):
    from v41_golden import V41_SMALL

    code, err = _run(capsys, ["serve", "--checkpoint", str(V41_SMALL), "--speculative", spec])
    assert code == 2 and words in err and "\n" not in err


def test_speculative_needs_draft_layers(capsys, tiny_ckpt):
    code, err = _run(capsys, ["serve", "--checkpoint", str(tiny_ckpt), "--speculative", "dspark"])
    assert code == 2 and "DSpark" in err
