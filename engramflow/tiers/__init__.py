"""Storage tiers for Engram table rows (docs/architecture.md, "Storage tiers").

Every place rows live is a `RowStore` (source.py: `gather` -> the checkpoint's MXFP8 bytes,
`lookup` -> rows decoded by the native gather-decode, one bounds check): `HostMmapSource` /
`memory.tables.EngramTable` (the mmap store), `SsdSource` (parallel direct reads),
`RemoteRamSource` (client of `TableServer`), `HotRowCache` (top-K rows resident on a device or
in RAM), and `TierStack`, which composes them under per-tier `Policy`s (fallback / retry /
reject). `parse_tiers` validates the per-layer pipeline config into a `TiersConfig`;
`build_stores` opens the stores it describes.
"""
from engramflow.tiers.config import (HostTier, HotConfig, LayerTiers, RemoteTier, SsdTier, TierSpec, TiersConfig,
                                     build_store, build_stores, parse_tiers)
from engramflow.tiers.hot_cache import HotRowCache, load_hot_rows
from engramflow.tiers.policy import Policy, TierStack
from engramflow.tiers.source import (AddressError, HostMmapSource, RowStore, TierError, TierUnavailable,
                                     check_addresses)
from engramflow.tiers.remote import RemoteRamSource
from engramflow.tiers.server import TableServer
from engramflow.tiers.ssd import SsdSource
from engramflow.tiers.stats import LatencyHistogram, TierStats

__all__ = ["RowStore", "HostMmapSource", "HotRowCache", "load_hot_rows", "Policy", "TierStack",
           "TierError", "TierUnavailable", "AddressError", "check_addresses", "TierStats", "LatencyHistogram",
           "SsdSource", "RemoteRamSource", "TableServer", "parse_tiers", "TiersConfig", "LayerTiers", "TierSpec",
           "HostTier", "SsdTier", "RemoteTier", "HotConfig", "build_store", "build_stores"]
