"""Constructor errors that are the user's (bad checkpoint, bad option), kept as values.

Ray turns an exception in an actor's __init__ into a dead actor whose error survives only as
text. Instead the constructor keeps the EngramflowError and `init_error()` returns its message,
so the launcher raises the same one-line error without reading Ray's text. Other exceptions
(bugs) still kill the actor with their traceback. `reinit` runs the constructor again with new
arguments, for a process kept for the next launch (pipeline/actor_pool.py), and `park` is
where such a process waits meanwhile.
"""
from __future__ import annotations

import functools
import gc
import threading

import ray

from engramflow.errors import EngramflowError

_LIFECYCLE = threading.Lock()


def _lifecycle() -> threading.Lock:
    """`park` and `reinit` of this process's actor, one at a time: a threaded actor may run
    them in either order (the pool sends `reinit` after `park`, but Ray orders no calls of a
    threaded actor). A function, not the lock: a class pickled by value takes it by name."""
    return _LIFECYCLE


def keep_init_error(cls):
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        self._init_error = None
        try:
            init(self, *args, **kwargs)
        except EngramflowError as e:
            self._init_error = str(e)

    def init_error(self) -> str | None:
        return self._init_error

    def reinit(self, *args, **kwargs) -> str | None:
        """A new actor in this process: the old state dropped, the constructor run on `args`;
        returns init_error(). An exception that is a bug propagates (the pool ends the actor)."""
        with _lifecycle():
            gc.unfreeze()  # a constructor froze the old state (freeze_long_lived): let it be collected
            self.__dict__.clear()
            __init__(self, *args, **kwargs)
            return self._init_error

    def park(self, gate, token: str) -> None:
        """Drop the old state (its weights too), then wait, blocked, until the pool opens `token`
        at `gate`: an idle Ray actor wakes 100 times a second to check for signals (~1 % of a
        core), one blocked in a call sleeps. The pool opens the token before it sends `reinit`:
        found open, the actor is handed out already (a threaded actor may have run `reinit`
        first), and its state is not touched. A gate that dies (the pool cleared, its driver
        gone) ends the wait all the same; `reinit` comes next."""
        try:
            with _lifecycle():
                if ray.get(gate.taken.remote(token)):
                    return
                gc.unfreeze()
                self.__dict__.clear()
                self._init_error = "a parked actor: re-initialise it before use"
                gc.collect()
            ray.get(gate.wait.remote(token))
        except ray.exceptions.RayError:
            pass

    cls.__init__ = __init__
    cls.init_error = init_error
    cls.reinit = reinit
    cls.park = park
    return cls
