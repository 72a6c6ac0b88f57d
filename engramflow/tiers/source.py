"""The storage tiers' view of the row-store abstraction (engramflow.memory.tables): the names
the tiers share, and the host-mmap tier (an `ArrayRowStore` that counts its requests).
"""
from __future__ import annotations

from engramflow.memory.tables import (AddressError, ArrayRowStore, EngramTable, RowStore, TierError,
                                      TierUnavailable, check_addresses)
from engramflow.tiers.stats import TierStats

__all__ = ["AddressError", "RowStore", "TierError", "TierUnavailable", "check_addresses", "HostMmapSource"]


class HostMmapSource(ArrayRowStore):
    """The host mmap store as a tier: rows read straight out of (mmapped or in-RAM) numpy arrays,
    with per-tier counters."""

    def __init__(self, codes, scales, layer: int | None = None, name: str = "host"):
        super().__init__(codes, scales, layer, name, TierStats(name, layer))

    @classmethod
    def from_table(cls, table: ArrayRowStore, name: str = "host") -> "HostMmapSource":
        """A tier over a table's arrays (keeps an EngramTable's MADV_RANDOM mapping)."""
        return cls(table.codes, table.scales, table.layer, name)

    @classmethod
    def from_checkpoint(cls, ckpt, layer: int, name: str = "host") -> "HostMmapSource":
        return cls.from_table(EngramTable(ckpt, layer), name)
