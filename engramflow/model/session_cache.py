"""Per-session state of a backbone stage, by session name: the bookkeeping every cache shares.

A session is a token stream with a `length`; what else an entry holds (K/V buffers, V4.1's
named caches) is the subclass's. Rollback is just a shorter length: truncating frees and
copies nothing, and later writes overwrite the stale rows.
"""
from __future__ import annotations

from engramflow.errors import EngramflowError


class SessionCache:
    def __init__(self, max_len: int):
        self.max_len = max_len
        self._sessions: dict = {}

    # what an entry is: subclasses say
    def _new_entry(self):
        raise NotImplementedError

    def _fork_entry(self, entry):
        raise NotImplementedError

    def _get(self, session: str):
        entry = self._sessions.get(session)
        if entry is None:
            raise EngramflowError(f"unknown session {session!r} (open it first)")
        return entry

    def __contains__(self, session: str) -> bool:
        return session in self._sessions

    def length(self, session: str) -> int:
        return self._get(session).length

    def sessions(self) -> list[str]:
        return list(self._sessions)

    def live_sessions(self) -> int:
        return len(self._sessions)

    def cached_positions(self) -> int:
        """Valid positions over all sessions: what a leak test expects back at zero."""
        return sum(s.length for s in self._sessions.values())

    def open(self, session: str) -> None:
        if session in self._sessions:
            raise EngramflowError(f"session {session!r} is already open")
        self._sessions[session] = self._new_entry()

    def close(self, session: str) -> None:
        self._get(session)
        del self._sessions[session]

    def reset(self, session: str) -> None:
        """Empty the session and drop its buffers; it stays open."""
        self._get(session)
        self._sessions[session] = self._new_entry()

    def fork(self, src: str, dst: str) -> None:
        """`dst` becomes an independent copy of `src`'s valid positions."""
        entry = self._get(src)
        if dst in self._sessions:
            raise EngramflowError(f"cannot fork {src!r} into {dst!r}: session {dst!r} is already open")
        self._sessions[dst] = self._fork_entry(entry)

    def truncate(self, session: str, length: int) -> None:
        entry = self._get(session)
        if isinstance(length, bool) or not isinstance(length, int) or not 0 <= length <= entry.length:
            raise EngramflowError(
                f"cannot truncate session {session!r} to length {length!r}: it holds {entry.length} positions")
        entry.length = length

    def check_end(self, session: str, end: int) -> None:
        if end > self.max_len:
            raise EngramflowError(f"session {session!r} would reach {end} positions, above max_seq_len={self.max_len}")

    def commit(self, session: str, length: int) -> None:
        """Positions below `length` are now valid (after every layer has written them)."""
        self._get(session).length = length
