"""`engramflow` command line. Each subcommand is a thin shell over library calls.

Bad input of any kind exits with status 2 and a one-line message on stderr. Output cut short
by its reader (`engramflow ... | head -1`) ends the command quietly with status 141
(128 + SIGPIPE), as a Unix tool killed by SIGPIPE does: no message, no traceback.
"""
from __future__ import annotations

import argparse
import contextlib
import errno
import os
import select
import sys

from engramflow import __version__
from engramflow.cli import addressing, checkpoints, data, doctor, pipeline, profiling, serve, tiers, timing
from engramflow.cli.quiet import quiet_ray
from engramflow.cli.suggest import unknown_arguments_hint, unknown_command_hint, unknown_flags
from engramflow.errors import EngramflowError
from engramflow.kernels import sum_order

# Commands that run a model: they take --numerics (kernels/sum_order.py)
NUMERICS_COMMANDS = {"demo", "generate", "serve", "prefill-job", "profile"}
# Commands that start no Ray and whose log lines are their operator's output (a server's errors):
# never quieted.
OWN_LOGS = {"serve-table"}
EXIT_BROKEN_PIPE = 128 + 13  # 128 + SIGPIPE, what a shell shows for `yes | head -1`


class _HelpFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default, unless the help already states one."""

    def _get_help_string(self, action):
        text = action.help or ""
        default = action.default
        if (default is None or default is False or default is argparse.SUPPRESS or not action.option_strings
                or "default" in text.lower() or isinstance(action, argparse._VersionAction)):
            return text
        return f"{text} (default: {default})"


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message):  # one line, exit 2, like every other bad input
        self.exit(2, f"{self.prog}: error: {message}{unknown_command_hint(message)}\n")

    def parse_args(self, args=None, namespace=None):
        """As argparse's, but an unknown flag is reported first (before a missing required one it
        may be a typo of), by the subcommand that was given it, with the closest known flags."""
        args = sys.argv[1:] if args is None else list(args)
        command = self._command_parser(args)
        if command is not None:
            unknown = unknown_flags(args, command)
            if unknown:
                self._unknown(command, unknown)
        ns, extras = self.parse_known_args(args, namespace)
        if extras:
            self._unknown(self._subcommands.choices.get(getattr(ns, "command", None)) or self, extras)
        return ns

    def _command_parser(self, args):
        """The (deepest) subcommand parser `args` name, e.g. `token-map export`'s; None if none."""
        parser, found = self, None
        for a in (x for x in args if not x.startswith("-")):
            sub = next((act for act in parser._actions if isinstance(act, argparse._SubParsersAction)), None)
            if sub is None or a not in sub.choices:
                break
            parser = found = sub.choices[a]
        return found

    @staticmethod
    def _unknown(parser, extras):
        hint = unknown_arguments_hint(extras, parser)
        parser.error(f"unrecognized arguments: {' '.join(extras)}" + (f" ({hint})" if hint else ""))


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="engramflow", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"engramflow {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser, metavar="COMMAND")
    parser._subcommands = sub

    for module in (addressing, checkpoints, timing, profiling, pipeline, data, tiers, doctor, serve):
        module.register(sub)
    for name, command in sub.choices.items():
        if name in NUMERICS_COMMANDS:
            command.add_argument("--numerics", choices=sum_order.NUMERICS, default=None,
                                 help="batched: a step's sessions share one forward and a session's bits never "
                                      "depend on its company or chunking; official: per-session forwards, bit for "
                                      "bit the official V4.1 code (default: $ENGRAMFLOW_NUMERICS, else batched)")
        if "--verbose" not in command._option_string_actions:
            command.add_argument("--verbose", action="store_true",
                                 help="show Ray's own log lines and progress bars (by default they go to Ray's log files)")
    return parser


def _stdout_reader_gone(e: BaseException) -> bool:
    """True when `e` is EPIPE and stdout's reader has gone away (a broken pipe elsewhere, e.g. a
    socket, is an ordinary error and is reported as one)."""
    if not (isinstance(e, BrokenPipeError) or (isinstance(e, OSError) and e.errno == errno.EPIPE)):
        return False
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # not a real file (tests capture it)
        return False
    try:
        poller = select.poll()
        poller.register(fd, select.POLLOUT)
        return any(ev & (select.POLLERR | select.POLLHUP) for _, ev in poller.poll(0))
    except (AttributeError, OSError, ValueError):  # no poll here: trust the errno
        return True


def _silence_stdout() -> None:
    """The reader is gone: point stdout at /dev/null so that the flush at interpreter exit
    (of whatever is still buffered) cannot raise again and print 'Exception ignored'."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # not a real file (tests capture it): nothing to do
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
    finally:
        os.close(devnull)


def main(argv=None) -> int:
    """Run one command; returns its exit status. stdout is flushed here, inside the handlers, so
    that a closed pipe surfaces now and not in the flush at interpreter exit."""
    code = 0
    try:
        code = _run(argv)
        sys.stdout.flush()
        return code
    except OSError as e:
        if not _stdout_reader_gone(e):
            raise
        _silence_stdout()
        return code or EXIT_BROKEN_PIPE  # an error already reported keeps its status


@contextlib.contextmanager
def _numerics(args):
    """--numerics as ENGRAMFLOW_NUMERICS for the command: every engine, pipeline and Serve replica
    it starts (a local Ray instance's workers inherit it) reads it; restored afterwards."""
    value = getattr(args, "numerics", None)
    before = os.environ.get("ENGRAMFLOW_NUMERICS")
    if value:
        os.environ["ENGRAMFLOW_NUMERICS"] = value
    try:
        yield
    finally:
        if value:
            if before is None:
                os.environ.pop("ENGRAMFLOW_NUMERICS", None)
            else:
                os.environ["ENGRAMFLOW_NUMERICS"] = before


def _run(argv) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # usage errors (already printed, one line) and --help
        return e.code if isinstance(e.code, int) else 2
    try:
        with quiet_ray(getattr(args, "verbose", False) or args.command in OWN_LOGS), _numerics(args):
            return args.func(args)
    except EngramflowError as e:
        print(f"engramflow {args.command}: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # unwritable output, unreadable input: the user's to fix, not a crash
        if _stdout_reader_gone(e):  # e.g. piped into `head`: main stops quietly
            raise
        where = f": {e.filename}" if e.filename else ""
        print(f"engramflow {args.command}: error: {e.strerror or e}{where}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("engramflow: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
