"""`engramflow` command line. Each subcommand is a thin shell over library calls.

Bad input of any kind exits with status 2 and a one-line message on stderr.
"""
from __future__ import annotations

import argparse
import sys

from engramflow.cli import addressing, checkpoints, data, doctor, pipeline, profiling, tiers, timing
from engramflow.errors import EngramflowError


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2, like every other bad input
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="engramflow", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    for module in (addressing, checkpoints, timing, profiling, pipeline, data, tiers, doctor):
        module.register(sub)
    return parser


def main(argv=None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # usage errors (already printed, one line) and --help
        return e.code if isinstance(e.code, int) else 2
    try:
        return args.func(args)
    except EngramflowError as e:
        print(f"engramflow {args.command}: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # unwritable output, unreadable input: the user's to fix, not a crash
        where = f": {e.filename}" if e.filename else ""
        print(f"engramflow {args.command}: error: {e.strerror or e}{where}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # e.g. piped into `head`
        return 0
    except KeyboardInterrupt:
        print("engramflow: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
