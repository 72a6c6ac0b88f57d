"""Printed quantities carry their unit."""
from __future__ import annotations


def format_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'; whole bytes below 1 KiB ('512 B')."""
    n = float(n)
    if abs(n) < 1024:
        return f"{n:.0f} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}"
    raise AssertionError("unreachable")
