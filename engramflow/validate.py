"""The checks every option a user passes goes through: one wording for each kind of value.

Each returns the value it checked and raises an EngramflowError that names the option and
the value it got. A bool is never a number here (Python counts True as 1; a user who wrote
`--depth true` made a mistake).
"""
from __future__ import annotations

import math

import numpy as np

from engramflow.errors import EngramflowError


def is_int(value) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, np.integer))


def is_number(value) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float, np.integer, np.floating))


def _range(lo, hi) -> str:
    if hi is None:
        return f">= {lo:g}" if isinstance(lo, float) else f">= {lo}"
    return f"in [{lo:g}, {hi:g}]" if isinstance(lo, float) or isinstance(hi, float) else f"in [{lo}, {hi}]"


def check_int(name: str, value, lo: int = 0, hi: int | None = None) -> int:
    """An integer in [lo, hi] (no upper bound when hi is None)."""
    if not is_int(value) or value < lo or (hi is not None and value > hi):
        raise EngramflowError(f"{name} must be an integer {_range(lo, hi)}, got {value!r}")
    return int(value)


def check_number(name: str, value, lo: float = 0.0, hi: float | None = None, unit: str = "a number") -> float:
    """A finite number in [lo, hi]; `unit` words it ("a number of ms")."""
    if not is_number(value) or not math.isfinite(value) or value < lo or (hi is not None and value > hi):
        raise EngramflowError(f"{name} must be {unit} {_range(float(lo), None if hi is None else float(hi))}, "
                              f"got {value!r}")
    return float(value)


def check_positive(name: str, value, unit: str = "a finite number") -> float:
    """A finite number > 0."""
    if not is_number(value) or not math.isfinite(value) or value <= 0:
        raise EngramflowError(f"{name} must be {unit} > 0, got {value!r}")
    return float(value)


