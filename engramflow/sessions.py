"""Session names, shared by every object that keeps per-session state."""
from __future__ import annotations

from collections.abc import Iterator, Mapping

from engramflow.errors import EngramflowError


def new_session_name(requested: str | None, taken: Mapping, counter: Iterator[int]) -> str:
    """`requested`, checked, or the next free "s<N>" name."""
    if requested is None:
        requested = next(n for n in (f"s{i}" for i in counter) if n not in taken)
    if not isinstance(requested, str) or not requested:
        raise EngramflowError(f"session name must be a non-empty string, got {requested!r}")
    if requested in taken:
        raise EngramflowError(f"session {requested!r} already exists")
    return requested


def session_entry(table: Mapping, session: str):
    """table[session], or the error every API gives for an unknown session."""
    try:
        return table[session]
    except (KeyError, TypeError):
        raise EngramflowError(f"unknown session {session!r} (never opened, or closed)") from None
