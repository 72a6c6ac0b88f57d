"""The command line a newcomer meets: --version, did-you-mean hints, help text and defaults."""
import argparse

import pytest

from engramflow import __version__
from engramflow.cli.app import build_parser, main


def run(argv, capsys):
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_version(capsys):
    with pytest.raises(SystemExit) as e:  # argparse's version action exits 0 after printing
        build_parser().parse_args(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"engramflow {__version__}"


@pytest.mark.parametrize("argv, hint", [
    (["genrate"], "did you mean generate?"),
    (["generate", "--checkpoint", "x", "--promt", "hi"], "--promt: did you mean --prompt?"),
    (["generate", "--checkpoint", "x", "--prompt", "hi", "--max_new_tokens", "3"],
     "--max_new_tokens: did you mean --max-new-tokens?"),
    (["prefill-job", "--checkpoint", "c", "--input", "i", "--output", "o", "--concurency", "2"],
     "did you mean --concurrency?"),
    (["inspect", "--checkpoint", "ckpt"], "engramflow inspect takes DIR without a flag"),
])
def test_typos_get_a_suggestion_on_one_line(argv, hint, capsys):
    code, out, err = run(argv, capsys)
    assert code == 2 and out == ""
    assert hint in err and len(err.strip().splitlines()) == 1, err


def test_a_flag_far_from_any_gets_no_made_up_suggestion(capsys):
    code, _, err = run(["generate", "--checkpoint", "x", "--prompt", "hi", "--zzzzzz"], capsys)
    assert code == 2 and "unrecognized arguments: --zzzzzz" in err and "did you mean" not in err


def test_every_option_of_every_command_has_help_and_states_its_default():
    parser = build_parser()
    seen = 0
    for name, command in parser._subcommands.choices.items():
        formatter = command._get_formatter()
        for action in command._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            assert action.help and action.help.strip(), f"{name} {action.option_strings or action.dest}: no help"
            seen += 1
            if action.option_strings and action.default not in (None, False, argparse.SUPPRESS):
                shown = formatter._get_help_string(action)
                assert "default" in shown.lower(), f"{name} {action.option_strings}: default not stated: {shown!r}"
    assert seen > 80  # every command, not a few


def test_help_states_a_default_once():
    text = " ".join(build_parser()._subcommands.choices["access-stats"].format_help().split())
    assert "default 100000" in text and "(default: 100000)" not in text  # the help's own wording wins
    gen = " ".join(build_parser()._subcommands.choices["generate"].format_help().split())
    assert "(default: 16)" in gen and "--verbose" in gen
