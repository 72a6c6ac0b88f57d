"""Storage-tier configuration: a typed, validated object, and the stores built from it.

The dict form users pass (`Engine(..., tiers=cfg)`, `Pipeline.launch(..., tiers=cfg)`); keys are
layer ids (strings or ints), "default" applies to the layers without an entry:

    {"14": {"hot": {"rows_file": "hot14.json", "top_k": 200000, "device": "cuda:0"},
            "tiers": [{"kind": "remote", "host": "10.0.0.7", "port": 7411,
                       "secret_file": "/etc/engramflow/secret", "timeout": 0.05, "policy": "fallback"},
                      {"kind": "ssd", "queue_depth": 64, "engine": "auto", "io": "auto", "scales": "resident",
                       "policy": {"mode": "retry", "retries": 2, "backoff_s": 0.002}},
                      {"kind": "host", "policy": "reject"}]},
     "default": {"tiers": [{"kind": "host"}]}}

`parse_tiers(raw, layer_ids)` turns it into a `TiersConfig` (frozen dataclasses: cheap, pickles),
checking every key, type and value, and that the named files exist, without opening anything;
errors name the key (`tiers['14'].tiers[0].policy: ...`). Each dataclass also validates itself
when constructed directly. `build_stores(config, ckpt, layer_ids)` opens the stores: per layer,
the hot cache (if any) over the tiers, tried top to bottom under their policies (policy.py); a
layer without an entry reads the plain host table.
"""
from __future__ import annotations

import dataclasses
import math
import os
from typing import ClassVar

import torch

from engramflow.errors import EngramflowError
from engramflow.io.checkpoint import engram_names
from engramflow.memory.tables import EngramTable, RowStore
from engramflow.tiers.hot_cache import HotRowCache, load_hot_rows
from engramflow.tiers.policy import Policy, TierStack
from engramflow.io.batch_read import ENGINES, MAX_QUEUE_DEPTH
from engramflow.tiers.ssd import MODES as SSD_MODES, SCALES as SSD_SCALES
from engramflow.tiers.protocol import read_secret_file
from engramflow.tiers.remote import RemoteRamSource
from engramflow.tiers.ssd import SsdSource
from engramflow.tiers.stats import TierStats

KINDS = ("host", "ssd", "remote")


def _int(value, key: str, lo: int, hi: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise EngramflowError(f"{key}: must be an integer in [{lo}, {hi}], got {value!r}")


def _seconds(value, key: str) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not (0 < value < math.inf):
        raise EngramflowError(f"{key}: must be a positive number of seconds, got {value!r}")


def _path(value, key: str) -> str:
    if not isinstance(value, (str, os.PathLike)) or not os.fspath(value):
        raise EngramflowError(f"{key}: must be a file path, got {value!r}")
    return os.fspath(value)


def _set(obj, **fields) -> None:
    for k, v in fields.items():
        object.__setattr__(obj, k, v)  # normalizing a frozen dataclass's own fields


@dataclasses.dataclass(frozen=True, kw_only=True)
class TierSpec:
    """One tier of a layer's stack. `policy`: what to do when it fails (policy.py)."""
    kind: ClassVar[str]
    name: str = ""  # "" = the kind
    policy: Policy = Policy("reject")

    def __post_init__(self):
        if not isinstance(self.name, str):
            raise EngramflowError(f"name: must be a string, got {self.name!r}")
        try:
            _set(self, name=self.name or self.kind, policy=Policy.parse(self.policy))
        except EngramflowError as e:
            raise EngramflowError(f"policy: {e}") from None


@dataclasses.dataclass(frozen=True, kw_only=True)
class HostTier(TierSpec):
    """The host mmap table."""
    kind: ClassVar[str] = "host"


@dataclasses.dataclass(frozen=True, kw_only=True)
class SsdTier(TierSpec):
    """Rows read in place from the checkpoint file, a request's reads in flight together (ssd.py).
    `queue_depth`: reads in flight; `engine`: auto | uring | threads; `readers`: threads of the
    thread engine (default: queue_depth); `io`: page-cache mode; `scales`: resident | read."""
    kind: ClassVar[str] = "ssd"
    readers: int | None = None
    queue_depth: int = 64
    engine: str = "auto"
    io: str = "auto"
    scales: str = "resident"

    def __post_init__(self):
        super().__post_init__()
        if self.readers is not None:
            _int(self.readers, "readers", 1, 256)
        _int(self.queue_depth, "queue_depth", 1, MAX_QUEUE_DEPTH)
        for key, allowed in (("engine", ENGINES), ("io", SSD_MODES), ("scales", SSD_SCALES)):
            if getattr(self, key) not in allowed:
                raise EngramflowError(f"{key}: must be one of {', '.join(allowed)}, got {getattr(self, key)!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RemoteTier(TierSpec):
    """A remote-RAM table server (server.py) at host:port, authenticated with `secret_file`."""
    kind: ClassVar[str] = "remote"
    port: int
    secret_file: str
    host: str = "127.0.0.1"
    timeout: float = 1.0
    connect_timeout: float = 1.0

    def __post_init__(self):
        super().__post_init__()
        _int(self.port, "port", 1, 65535)
        _set(self, secret_file=_path(self.secret_file, "secret_file"))
        if not isinstance(self.host, str) or not self.host:
            raise EngramflowError(f"host: must be a host name or address, got {self.host!r}")
        _seconds(self.timeout, "timeout")
        _seconds(self.connect_timeout, "connect_timeout")


TIER_TYPES: dict[str, type[TierSpec]] = {t.kind: t for t in (HostTier, SsdTier, RemoteTier)}


@dataclasses.dataclass(frozen=True, kw_only=True)
class HotConfig:
    """The hot-row cache: the first `top_k` rows of an access-stats hot-row list, on `device`."""
    rows_file: str
    top_k: int | None = None
    device: str = "cpu"

    def __post_init__(self):
        _set(self, rows_file=_path(self.rows_file, "rows_file"))
        if self.top_k is not None:
            _int(self.top_k, "top_k", 0, 2**62)
        try:
            _set(self, device=str(torch.device(self.device)))  # parses only: no device is touched
        except (RuntimeError, TypeError) as e:
            raise EngramflowError(f"device: not a torch device: {self.device!r} ({e})") from None


@dataclasses.dataclass(frozen=True, kw_only=True)
class LayerTiers:
    """One layer's storage: the hot cache (optional) over the tiers, tried top to bottom."""
    tiers: tuple[TierSpec, ...] = (HostTier(),)
    hot: HotConfig | None = None

    def __post_init__(self):
        tiers = tuple(self.tiers) or (HostTier(),)
        for i, t in enumerate(tiers):
            if not isinstance(t, TierSpec):
                raise EngramflowError(f"tiers[{i}]: must be a HostTier, SsdTier or RemoteTier, got {t!r}")
        last = tiers[-1]
        if last.policy.falls_through:
            raise EngramflowError(f"tiers[{len(tiers) - 1}].policy: the last tier {last.name!r} has policy "
                                  f"{last.policy.mode!r}{' then fallback' if last.policy.mode == 'retry' else ''}, "
                                  "but there is no tier below it to fall back to")
        if self.hot is not None and not isinstance(self.hot, HotConfig):
            raise EngramflowError(f"hot: must be a HotConfig, got {self.hot!r}")
        _set(self, tiers=tiers)

    def files(self) -> list[tuple[str, str]]:
        """(key, path) of every file this layer's storage reads at build time."""
        out = [(f"tiers[{i}].secret_file", t.secret_file) for i, t in enumerate(self.tiers)
               if isinstance(t, RemoteTier)]
        return ([("hot.rows_file", self.hot.rows_file)] if self.hot else []) + out


@dataclasses.dataclass(frozen=True)
class TiersConfig:
    """Per Engram layer id, its storage; layers not listed read the plain host table."""
    layers: dict[int, LayerTiers] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        for l, spec in self.layers.items():
            if not isinstance(l, int) or isinstance(l, bool) or not isinstance(spec, LayerTiers):
                raise EngramflowError(f"tiers[{l!r}]: expected layer id (int) -> LayerTiers, got {spec!r}")

    def __bool__(self) -> bool:
        return bool(self.layers)

    def check_files(self, keys: dict[int, str] | None = None) -> None:
        """Every file the stores will read exists (a stat; nothing is opened). `keys`: how errors
        name each layer's entry (default tiers[<layer>])."""
        seen = set()
        for l, spec in self.layers.items():
            if id(spec) in seen:  # "default" is shared by many layers
                continue
            seen.add(id(spec))
            for key, path in spec.files():
                if not os.path.isfile(path):
                    where = (keys or {}).get(l, f"tiers[{l}]")
                    raise EngramflowError(f"{where}.{key}: no such file: {path}")


# -- the dict form ---------------------------------------------------------------------------
_LAYER_KEYS = ("hot", "tiers")
_HOT_KEYS = tuple(f.name for f in dataclasses.fields(HotConfig))


def _tier(raw, path: str) -> TierSpec:
    if not isinstance(raw, dict) or raw.get("kind") not in KINDS:
        raise EngramflowError(f"{path}: each tier needs kind one of {', '.join(KINDS)}, got {raw!r}")
    cls = TIER_TYPES[raw["kind"]]
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = set(raw) - fields - {"kind"}
    if unknown:
        raise EngramflowError(f"{path}: unknown key(s) {sorted(map(str, unknown))} for a {cls.kind} tier "
                              f"(known: {', '.join(sorted(fields))})")
    missing = [f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING and f.name not in raw]
    if missing:
        raise EngramflowError(f"{path}: a {cls.kind} tier needs {' and '.join(repr(k) for k in missing)}")
    return _construct(cls, {k: v for k, v in raw.items() if k != "kind"}, path)


def _construct(cls, kwargs: dict, path: str):
    try:
        return cls(**kwargs)
    except EngramflowError as e:
        raise EngramflowError(f"{path}.{e}") from None


def _layer(raw, path: str) -> LayerTiers | None:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise EngramflowError(f"{path}: must be a mapping with 'tiers' and/or 'hot', got {raw!r}")
    unknown = set(raw) - set(_LAYER_KEYS)
    if unknown:
        raise EngramflowError(f"{path}: unknown key(s) {sorted(map(str, unknown))} (known: {', '.join(_LAYER_KEYS)})")
    tiers = raw.get("tiers") or []
    if not isinstance(tiers, (list, tuple)):
        raise EngramflowError(f"{path}.tiers: must be a list of tiers, got {tiers!r}")
    specs = tuple(_tier(t, f"{path}.tiers[{i}]") for i, t in enumerate(tiers))
    hot = raw.get("hot")
    if hot:
        if not isinstance(hot, dict):
            raise EngramflowError(f"{path}.hot: must be a mapping, got {hot!r}")
        unknown = set(hot) - set(_HOT_KEYS)
        if unknown:
            raise EngramflowError(f"{path}.hot: unknown key(s) {sorted(map(str, unknown))} "
                                  f"(known: {', '.join(_HOT_KEYS)})")
        if "rows_file" not in hot:
            raise EngramflowError(f"{path}.hot: the hot cache needs 'rows_file' (an access-stats hot-row list)")
        hot = _construct(HotConfig, hot, f"{path}.hot")
    return _construct(LayerTiers, {"tiers": specs, "hot": hot or None}, path)


def parse_tiers(raw, layer_ids, check_files: bool = True) -> TiersConfig:
    """The validated `TiersConfig` for a checkpoint whose Engram layers are `layer_ids`.

    `raw`: the dict form (module docstring), a TiersConfig (checked against `layer_ids`), or
    None / {} (no tiers: every layer reads the host table). Errors name the offending key.
    `check_files`: also check that hot-row lists and secret files exist (turn it off when they
    live only on the machines the projection actors run on).
    """
    layers = [int(l) for l in layer_ids]
    if isinstance(raw, TiersConfig):
        extra = sorted(set(raw.layers) - set(layers))
        if extra:
            raise EngramflowError(f"tiers: the config names layer(s) {extra}, but the Engram layers are {layers}")
        config = raw
    elif not raw:
        config = TiersConfig()
    elif not isinstance(raw, dict):
        raise EngramflowError(f"tiers: must be a mapping of layer id -> tier config, got {type(raw).__name__}")
    else:
        by_layer: dict[int, object] = {}
        for key in raw:
            if key == "default":
                continue
            s = str(key)
            if isinstance(key, bool) or not s.lstrip("-").isdigit() or int(s) not in layers:
                raise EngramflowError(f"tiers: the config names layer {key!r}, but the Engram layers are {layers}")
            if int(s) in by_layer:
                raise EngramflowError(f"tiers: layer {s} is given twice ({by_layer[int(s)]!r} and {key!r})")
            by_layer[int(s)] = key
        default = _layer(raw["default"], "tiers['default']") if "default" in raw else None
        out, keys = {}, {}
        for l in layers:
            key = f"tiers[{by_layer[l]!r}]" if l in by_layer else "tiers['default']"
            spec = _layer(raw[by_layer[l]], key) if l in by_layer else default
            if spec is not None:
                out[l], keys[l] = spec, key
        config = TiersConfig(out)
        if check_files:
            config.check_files(keys)
        return config
    if check_files:
        config.check_files()
    return config


# -- building the stores ---------------------------------------------------------------------
def _open_tier(spec: TierSpec, ckpt, layer: int) -> RowStore:
    if isinstance(spec, HostTier):
        return EngramTable(ckpt, layer, name=spec.name, stats=TierStats(spec.name, layer))
    if isinstance(spec, SsdTier):
        return SsdSource.from_checkpoint(ckpt, layer, spec.readers, spec.io, name=spec.name,
                                         queue_depth=spec.queue_depth, engine=spec.engine, scales=spec.scales)
    rows, head_dim = ckpt.info(engram_names(layer)["embed.weight"]).shape  # the table the server must hold
    return RemoteRamSource(spec.host, spec.port, read_secret_file(spec.secret_file), rows, head_dim, layer,
                           spec.timeout, spec.connect_timeout, name=spec.name)


def build_store(spec: LayerTiers | None, ckpt, layer: int) -> RowStore:
    """One layer's store: the plain host table without a spec; else the hot cache (optional) over
    the tier stack."""
    if spec is None:
        return EngramTable(ckpt, layer)
    levels: list = []
    try:
        for t in spec.tiers:
            levels.append((_open_tier(t, ckpt, layer), t.policy))
        store: RowStore = TierStack(levels, layer)
        if spec.hot is not None:
            ids = load_hot_rows(spec.hot.rows_file, layer, spec.hot.top_k)
            store = HotRowCache(store, ids, spec.hot.device, layer=layer)
    except BaseException:
        for src, _ in levels:
            src.close()
        raise
    store.columns = ckpt.config.engram_columns
    return store


def build_stores(tiers, ckpt, layer_ids=None) -> dict[int, RowStore]:
    """{layer id: store} for `layer_ids` (default: every Engram layer of the checkpoint).
    `tiers`: a TiersConfig, the dict form (parsed here), or None."""
    config = parse_tiers(tiers, ckpt.config.engram_layer_ids, check_files=False)  # build reports missing files
    stores: dict[int, RowStore] = {}
    try:
        for l in (ckpt.config.engram_layer_ids if layer_ids is None else layer_ids):
            stores[l] = build_store(config.layers.get(l), ckpt, l)
    except BaseException:
        for s in stores.values():
            s.close()
        raise
    return stores
