"""Did-you-mean hints for the command line: an unknown command or flag is answered with the
closest known ones (a typo, or `_` for `-`), and a flag that names a positional argument says so."""
from __future__ import annotations

import difflib
import re


def _norm(flag: str) -> str:
    return flag.lower().replace("_", "-")


def close_flags(unknown: str, known: list[str]) -> list[str]:
    """Known flags close to `unknown` (`--promt` -> `--prompt`, `--max_new_tokens` -> `--max-new-tokens`)."""
    flag = unknown.split("=", 1)[0]
    by_norm = {_norm(k): k for k in known if k.startswith("--")}
    return [by_norm[m] for m in difflib.get_close_matches(_norm(flag), list(by_norm), n=2, cutoff=0.7)]


def unknown_arguments_hint(extras: list[str], parser) -> str:
    """The hint for `unrecognized arguments: ...` of `parser` (a subcommand's parser)."""
    known = [s for a in parser._actions for s in a.option_strings]
    positionals = [a.metavar or a.dest for a in parser._actions if not a.option_strings and a.dest != "command"]
    hints = []
    for e in (x for x in extras if x.startswith("-")):
        flag = e.split("=", 1)[0]
        matches = close_flags(flag, known)
        if matches:
            hints.append(f"{flag}: did you mean {' or '.join(matches)}?")
        elif positionals:
            names = " ".join(p.upper() for p in positionals)
            hints.append(f"{flag} is not an option; {parser.prog} takes {names} without a flag "
                         f"(usage: {parser.prog} {names} ...)")
    return "; ".join(hints)


def unknown_command_hint(message: str) -> str:
    """The hint for argparse's `invalid choice: 'x' (choose from ...)`, or ''."""
    m = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
    if not m:
        return ""
    choices = re.findall(r"'([^']*)'", m.group(2)) or [c.strip() for c in m.group(2).split(",")]
    matches = difflib.get_close_matches(m.group(1), choices, n=2, cutoff=0.6)
    return f"; did you mean {' or '.join(matches)}?" if matches else ""


def unknown_flags(args: list[str], parser) -> list[str]:
    """The `--flags` in `args` that `parser` does not know (nor as an unambiguous prefix, which
    argparse accepts); values after `--` are not flags."""
    known = [s for a in parser._actions for s in a.option_strings]
    unknown = []
    for a in args:
        if a == "--":
            break
        if not a.startswith("--"):
            continue
        flag = a.split("=", 1)[0]
        if flag not in known and sum(k.startswith(flag) for k in known) != 1:
            unknown.append(flag)
    return unknown
