"""Retired sessions kept for their prefix: a new prompt forks the one it shares most with.

Each entry is an open runner session and its key: one int64 per position of the session (the
token id, or for an image position a value derived from the image's pixels: prefix_key.py), so
two keys agree on a prefix exactly when the sessions' states agree there. `lookup` finds the
entry with the longest common prefix with a new key; `insert` takes a session over; entries
are evicted least recently used to stay within a byte budget (a session's bytes: its length
times what one cached token costs, model/token_cost.py), and the cache closes what it drops.

Why a scan and not a radix tree: the budget bounds the entries to tens or hundreds of
sessions of a few thousand tokens; comparing a prompt with all of them is one vectorized
compare per entry, microseconds against the milliseconds of the prefill it saves. A tree would
add code (splits, merges, per-node bookkeeping) for nothing measurable at this scale.

A session whose key is a prefix of a newer entry's is redundant (the newer one answers every
lookup it could, as well) and is dropped at once; a new session that is itself a prefix of an
entry is closed instead of kept. A fork taken from an entry is a session of its own: evicting
the entry never touches it.

Plain Python, no Ray, called only from the scheduler's thread (stats may be read from others).
"""
from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable

import numpy as np

from engramflow.errors import EngramflowError


@dataclasses.dataclass
class Entry:
    session: str
    key: np.ndarray  # int64 [length]
    nbytes: int


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading positions a and b share."""
    n = min(a.size, b.size)
    if n == 0:
        return 0
    diff = np.flatnonzero(a[:n] != b[:n])
    return n if diff.size == 0 else int(diff[0])


class PrefixCache:
    def __init__(self, budget_bytes: int, token_bytes: int, close: Callable[[str], None]):
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 0:
            raise EngramflowError(f"prefix cache budget must be a whole number of bytes >= 0, got {budget_bytes!r}")
        if isinstance(token_bytes, bool) or not isinstance(token_bytes, int) or token_bytes < 1:
            raise EngramflowError(f"bytes per cached token must be a whole number >= 1, got {token_bytes!r}")
        self.budget, self.token_bytes, self._close = budget_bytes, token_bytes, close
        self._entries: collections.OrderedDict[str, Entry] = collections.OrderedDict()  # oldest use first
        self.bytes = 0
        self.lookups = self.hits = self.cached_tokens = self.prompt_tokens = self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, session: str) -> bool:
        return session in self._entries

    def lookup(self, key: np.ndarray, limit: int) -> tuple[str, int] | None:
        """(the entry's session, shared length <= limit) with the longest prefix shared with
        `key`, or None when none shares a position. The entry counts as just used."""
        self.lookups += 1
        self.prompt_tokens += int(key.size)
        best, best_n = None, 0
        for entry in self._entries.values():
            n = common_prefix(entry.key, key)
            if n > best_n:
                best, best_n = entry, n
        best_n = min(best_n, limit)
        if best is None or best_n < 1:
            return None
        self._entries.move_to_end(best.session)
        return best.session, best_n

    def hit(self, tokens: int) -> None:
        """A lookup's prefix was used: `tokens` of the prompt are not prefilled."""
        self.hits += 1
        self.cached_tokens += tokens

    def insert(self, session: str, key: np.ndarray) -> bool:
        """Take `session` (its state is `key`'s positions) over; False when it was not kept
        (then it is closed here: too big for the budget, empty, or already covered)."""
        if session in self._entries:
            raise EngramflowError(f"session {session!r} is already in the prefix cache")
        key = np.asarray(key, dtype=np.int64)
        nbytes = int(key.size) * self.token_bytes
        if key.size == 0 or nbytes > self.budget:
            self._close(session)
            return False
        for entry in list(self._entries.values()):
            n = common_prefix(entry.key, key)
            if n == key.size:  # the new one is a prefix of an entry: nothing new to keep
                self._entries.move_to_end(entry.session)
                self._close(session)
                return False
            if n == entry.key.size:  # an entry is a prefix of the new one: redundant now
                self._drop(entry)
        self._entries[session] = Entry(session, key, nbytes)
        self.bytes += nbytes
        while self.bytes > self.budget:
            self.evictions += 1
            self._drop(next(iter(self._entries.values())))
        return True

    def clear(self) -> None:
        """Close every entry (the runner is being shut down or replaced)."""
        for entry in list(self._entries.values()):
            self._drop(entry)

    def forget(self, sessions) -> None:
        """Drop entries whose sessions the runner no longer has (without closing them)."""
        for s in [s for s in self._entries if s not in sessions]:
            self.bytes -= self._entries.pop(s).nbytes

    def _drop(self, entry: Entry) -> None:
        del self._entries[entry.session]
        self.bytes -= entry.nbytes
        self._close(entry.session)

    def stats(self) -> dict:
        return {"entries": len(self._entries), "bytes": self.bytes, "budget_bytes": self.budget,
                "token_bytes": self.token_bytes, "lookups": self.lookups, "hits": self.hits,
                "cached_tokens": self.cached_tokens, "prompt_tokens": self.prompt_tokens,
                "hit_rate": self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0,
                "evictions": self.evictions}
