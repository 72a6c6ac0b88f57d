"""Build a layer's row source from the pipeline config.

Per layer (keys are layer ids as strings, "default" applies to the rest):

    {"14": {"hot": {"rows_file": "hot14.json", "top_k": 200000, "device": "cuda:0"},
            "tiers": [{"kind": "remote", "host": "10.0.0.7", "port": 7411,
                       "secret_file": "/etc/engramflow/secret", "timeout": 0.05, "policy": "fallback"},
                      {"kind": "ssd", "readers": 8, "io": "auto",
                       "policy": {"mode": "retry", "retries": 2, "backoff_s": 0.002}},
                      {"kind": "host", "policy": "reject"}]},
     "default": {"tiers": [{"kind": "host"}]}}

Tiers are tried top to bottom under their policies (policy.py); the hot cache, if any, sits
above them all. With no entry for a layer, the layer reads the host mmap store alone.
"""
from __future__ import annotations

from engramflow.errors import EngramflowError
from engramflow.tiers.hot_cache import HotRowCache, load_hot_rows
from engramflow.tiers.policy import Policy, TierStack
from engramflow.tiers.source import HostMmapSource, RowSource

KINDS = ("host", "ssd", "remote")
_KEYS = {"host": set(), "ssd": {"readers", "io"},
         "remote": {"host", "port", "secret_file", "timeout", "connect_timeout"}}


def _tier(spec: dict, ckpt, layer: int) -> tuple[RowSource, Policy]:
    if not isinstance(spec, dict) or spec.get("kind") not in KINDS:
        raise EngramflowError(f"layer {layer}: each tier needs kind one of {', '.join(KINDS)}, got {spec!r}")
    kind = spec["kind"]
    unknown = set(spec) - _KEYS[kind] - {"kind", "policy", "name"}
    if unknown:
        raise EngramflowError(f"layer {layer}: unknown key(s) {sorted(unknown)} for a {kind} tier")
    name = spec.get("name", kind)
    if kind == "host":
        src = HostMmapSource.from_checkpoint(ckpt, layer, name=name)
    elif kind == "ssd":
        from engramflow.tiers.ssd import SsdSource
        src = SsdSource.from_checkpoint(ckpt, layer, spec.get("readers", 4), spec.get("io", "auto"), name=name)
    else:
        from engramflow.tiers.protocol import read_secret_file
        from engramflow.tiers.remote import RemoteRamSource
        if "port" not in spec or "secret_file" not in spec:
            raise EngramflowError(f"layer {layer}: a remote tier needs 'port' and 'secret_file'")
        host = HostMmapSource.from_checkpoint(ckpt, layer)  # only for the expected table shape
        src = RemoteRamSource(spec.get("host", "127.0.0.1"), spec["port"], read_secret_file(spec["secret_file"]),
                              host.rows, host.head_dim, layer, spec.get("timeout", 1.0),
                              spec.get("connect_timeout", 1.0), name=name)
    return src, Policy.parse(spec.get("policy", "reject"))


def build_source(spec: dict | None, ckpt, layer: int) -> RowSource:
    """One layer's source: hot cache (optional) over the tier stack."""
    spec = spec or {"tiers": [{"kind": "host"}]}
    unknown = set(spec) - {"hot", "tiers"}
    if unknown:
        raise EngramflowError(f"layer {layer}: unknown tier config key(s) {sorted(unknown)}")
    tiers = spec.get("tiers") or [{"kind": "host"}]
    if not isinstance(tiers, list):
        raise EngramflowError(f"layer {layer}: 'tiers' must be a list, got {tiers!r}")
    source: RowSource = TierStack([_tier(t, ckpt, layer) for t in tiers], layer)
    hot = spec.get("hot")
    if hot:
        if "rows_file" not in hot:
            raise EngramflowError(f"layer {layer}: the hot cache needs 'rows_file' (an access-stats hot-row list)")
        ids = load_hot_rows(hot["rows_file"], layer, hot.get("top_k"))
        source = HotRowCache(source, ids, hot.get("device", "cpu"), layer=layer)
    return source


def build_sources(config: dict | None, ckpt) -> dict[int, RowSource]:
    """{layer id: source} for every Engram layer of the checkpoint."""
    config = dict(config or {})
    layers = [int(l) for l in ckpt.config.engram_layer_ids]
    for key in config:
        if key != "default" and (not str(key).lstrip("-").isdigit() or int(key) not in layers):
            raise EngramflowError(f"tier config names layer {key!r}, but the Engram layers are {layers}")
    default = config.get("default")
    return {l: build_source(config.get(str(l), config.get(l, default)), ckpt, l) for l in layers}
