"""Hot-row cache: the top-K most accessed rows, resident in host RAM or on the projection's device.

Engram accesses are skewed (frequent n-grams hit the same rows), so a few percent of a table
can serve most reads. The cache is static: it is filled once from the lower tier with a hot-row
list (hottest first, as `access-stats` writes it), then every gather looks its ids up in the
sorted resident id list and asks the lower tier only for the misses, in one call.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from engramflow.errors import EngramflowError
from engramflow.tiers.source import RowStore, check_addresses
from engramflow.tiers.stats import TierStats

_FILL_CHUNK = 1 << 16  # rows per lower-tier request while filling


def load_hot_rows(path: str | Path, layer: int | None = None, top_k: int | None = None) -> np.ndarray:
    """Row ids, hottest first, from a hot-row list file; the first `top_k` of them.

    Accepted: `.npy` (ids [K] or [K, >=2] with ids in column 0); `.json`: a list of ids, or an
    object with "rows"/"hot_rows" (list of ids or of [id, count] pairs), optionally under
    "layers": {"<layer>": ...}; anything else: text, one id per line (extra columns and lines
    starting with '#' ignored).
    """
    p = Path(path)
    if not p.is_file():
        raise EngramflowError(f"hot-row list not found: {p}")
    if top_k is not None and top_k < 0:
        raise EngramflowError(f"hot-row top_k must be >= 0, got {top_k}")
    if p.suffix == ".npy":
        ids = np.load(p)
        ids = ids[:, 0] if ids.ndim == 2 else ids
    elif p.suffix == ".json":
        ids = _json_ids(json.loads(p.read_text()), layer, p)
    else:
        lines = [ln.replace(",", " ").split() for ln in p.read_text().splitlines()]
        try:
            ids = np.array([int(ln[0]) for ln in lines if ln and not ln[0].startswith("#")], dtype=np.int64)
        except ValueError as e:
            raise EngramflowError(f"{p}: not a list of row ids ({e})") from None
    ids = np.asarray(ids)
    if ids.ndim != 1 or (ids.size and not np.issubdtype(ids.dtype, np.integer)):
        raise EngramflowError(f"{p}: hot rows must be a list of integer row ids, got {ids.dtype} {list(ids.shape)}")
    return ids.astype(np.int64)[:top_k]


def _json_ids(doc, layer, p):
    if isinstance(doc, dict) and "layers" in doc:
        layers = doc["layers"]
        if str(layer) not in layers:
            raise EngramflowError(f"{p}: no hot rows for layer {layer} (have {sorted(layers)})")
        doc = layers[str(layer)]
    if isinstance(doc, dict):
        key = next((k for k in ("hot_rows", "rows") if k in doc), None)
        if key is None:
            raise EngramflowError(f"{p}: expected a 'rows' or 'hot_rows' list")
        doc = doc[key]
    if not isinstance(doc, list):
        raise EngramflowError(f"{p}: hot rows must be a list")
    return [r[0] if isinstance(r, list) else r for r in doc]


class HotRowCache(RowStore):
    """Resident copy of `hot_ids` rows of `lower`, checked before it. Counts row hits and misses."""

    def __init__(self, lower: RowStore, hot_ids, device: str | torch.device = "cpu", name: str = "hot",
                 layer: int | None = None):
        self.lower = lower
        self.rows, self.head_dim = lower.rows, lower.head_dim
        self.name, self.layer = name, lower.layer if layer is None else layer
        # sorted, unique: searchsorted finds a row's slot
        self.ids = ids = np.unique(check_addresses(hot_ids, lower.rows, f"{self.where()} hot-row list").reshape(-1))
        self.device = torch.device(device)
        self.stats = TierStats(name, self.layer)
        codes = np.empty((ids.size, self.head_dim), np.uint8)
        scales = np.empty((ids.size, self.scale_dim), np.uint8)
        for a in range(0, ids.size, _FILL_CHUNK):
            codes[a:a + _FILL_CHUNK], scales[a:a + _FILL_CHUNK] = lower._fetch(ids[a:a + _FILL_CHUNK])
        # host copies stay numpy (fast fancy indexing, and the decode kernel reads them in place);
        # a device cache keeps torch tensors there
        self._host = (codes, scales) if self.device.type == "cpu" else None
        self._dev = None if self._host else (torch.from_numpy(codes).to(self.device),
                                             torch.from_numpy(scales).to(self.device))

    def __len__(self) -> int:
        return int(self.ids.size)

    def _lookup(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
        """Slot of each id, whether it is resident, and how many are; counts hits and misses per row."""
        if not self.ids.size:
            slot, hit = np.zeros(ids.shape, np.int64), np.zeros(ids.shape, bool)
        else:
            slot = np.searchsorted(self.ids, ids)
            np.minimum(slot, self.ids.size - 1, out=slot)  # ids past the last resident one
            hit = self.ids[slot] == ids
        n_hit = int(np.count_nonzero(hit))
        self.stats.add_many(hits=n_hit, misses=ids.size - n_hit)
        return slot, hit, n_hit

    def _gather(self, ids):
        return self._rows(ids, *self._lookup(ids))

    def _rows(self, ids, slot, hit, n_hit):
        """Host bytes of `ids`: hits from the cache, the misses from below in one call."""
        if self._host is None:  # device cache asked for host bytes: copy the hits back
            c, s = self._gather_device(ids, slot, hit, torch.device("cpu"))
            return c.numpy(), s.numpy()
        codes, scales = self._host
        if n_hit == ids.size:  # the common case once the cache is sized right: no merge
            return codes[slot], scales[slot]
        if n_hit == 0:
            return self.lower._fetch(ids)
        out_c = np.empty((ids.size, self.head_dim), np.uint8)
        out_s = np.empty((ids.size, self.scale_dim), np.uint8)
        hi, mi = np.flatnonzero(hit), np.flatnonzero(~hit)
        out_c[hi], out_s[hi] = codes[slot[hi]], scales[slot[hi]]
        out_c[mi], out_s[mi] = self.lower._fetch(ids[mi])
        return out_c, out_s

    def _gather_view(self, a):
        flat = a.reshape(-1)
        slot, hit, n_hit = self._lookup(flat)
        if self._host is not None and n_hit == flat.size:  # all resident: decode straight from the cache
            return self._host[0], self._host[1], slot.reshape(a.shape)
        codes, scales = self._rows(flat, slot, hit, n_hit)
        return codes, scales, np.arange(flat.size, dtype=np.int64).reshape(a.shape)

    def _gather_tensors(self, ids, device):
        if self._dev is None or device != self.device:
            return super()._gather_tensors(ids, device)
        slot, hit, _ = self._lookup(ids)
        return self._gather_device(ids, slot, hit, device)

    def _gather_device(self, ids, slot, hit, device):
        """Hits gathered on the cache's device; misses fetched below, uploaded once, scattered in."""
        n = ids.size
        codes = torch.empty((n, self.head_dim), dtype=torch.uint8, device=self.device)
        scales = torch.empty((n, self.scale_dim), dtype=torch.uint8, device=self.device)
        hit_pos = torch.from_numpy(np.flatnonzero(hit)).to(self.device)
        hit_slot = torch.from_numpy(slot[hit]).to(self.device)
        codes[hit_pos], scales[hit_pos] = self._dev[0][hit_slot], self._dev[1][hit_slot]
        if not hit.all():
            mc, ms = self.lower._fetch(ids[~hit])
            miss_pos = torch.from_numpy(np.flatnonzero(~hit)).to(self.device)
            codes[miss_pos] = torch.from_numpy(mc).to(self.device)
            scales[miss_pos] = torch.from_numpy(ms).to(self.device)
        return codes.to(device), scales.to(device)

    @property
    def io_bound(self) -> bool:
        """Misses wait on the store below (prefetch.py)."""
        return bool(getattr(self.lower, "io_bound", False))

    def close(self) -> None:
        self.lower.close()
