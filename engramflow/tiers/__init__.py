"""Storage tiers for Engram table rows (issue 8).

Every tier is a `RowSource` (gather row ids -> MXFP8 codes and scales, byte-identical to the
checkpoint): `HostMmapSource` (the mmap store), `SsdSource` (parallel direct reads),
`RemoteRamSource` (client of `TableServer`), `HotRowCache` (top-K rows resident on a device or
in RAM). `TierStack` composes them under per-tier `Policy`s (fallback / retry / reject);
`SourceTable` gives any source `EngramTable`'s `lookup`; `build_sources` reads the per-layer
pipeline config.
"""
from engramflow.tiers.config import build_source, build_sources
from engramflow.tiers.hot_cache import HotRowCache, load_hot_rows
from engramflow.tiers.policy import Policy, TierStack
from engramflow.tiers.source import (HostMmapSource, RowSource, SourceTable, TierError, TierUnavailable,
                                     check_row_ids)
from engramflow.tiers.remote import RemoteRamSource
from engramflow.tiers.server import TableServer
from engramflow.tiers.ssd import SsdSource
from engramflow.tiers.stats import LatencyHistogram, TierStats

__all__ = ["RowSource", "HostMmapSource", "SourceTable", "HotRowCache", "load_hot_rows", "Policy", "TierStack",
           "TierError", "TierUnavailable", "TierStats", "LatencyHistogram",
           "SsdSource", "RemoteRamSource", "TableServer", "build_source", "build_sources",
           "check_row_ids"]
