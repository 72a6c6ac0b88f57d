"""Measure the numbers `projection="auto"` decides from, once, at launch.

* host rate: a projection actor projects random rows at T = 1 and T = 512
  (`EngramProjectionActor.calibrate`);
* stage rate: a stage decodes and projects random MXFP8 rows the same way
  (`BackboneStageActor.calibrate`, on its device). A CPU stage on the projection actor's node
  computes on the same cores: it is given the host's rate rather than a second, noisy
  measurement of the same CPU (see projection_placement.py);
* link: a payload of 4 KiB and one of 32 MiB made by the projection actor and fetched by the
  stage (through Ray's object store: shared memory on one node, the network across nodes),
  timed end to end from the driver: latency = the small one, bandwidth = the difference.

Each measurement runs alone (the host and a CPU stage may share cores). `rates` overrides any
of them, as {"host": {"decode_s", "per_token_s"}, "stage": {...}, "link": {"latency_s",
"bytes_per_s"}, "margin": f, "min_gain_s": s}: a configured link across nodes, or injected numbers
in tests.
"""
from __future__ import annotations

import time

import ray

from engramflow.errors import EngramflowError
from engramflow.pipeline.projection_placement import (LinkRate, PlacementModel, ProjectionPlacement,
                                                       ProjectionRate, check_projection_mode)

PROBE_SMALL, PROBE_LARGE = 4 << 10, 32 << 20
_KEYS = {"host", "stage", "link", "margin", "min_gain_s"}


def bytes_per_token(cfg) -> tuple[int, int]:
    """(K/V bytes as shipped: fp32, rows bytes as stored: MXFP8) per position and layer."""
    kv = cfg.engram_output_dim * 4
    rows = cfg.engram_columns * (cfg.engram_head_dim + cfg.engram_head_dim // 32)
    return kv, rows


def _best_seconds(call, repeat: int = 3) -> float:
    call()  # warm
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_link(projection_actor, stage_actor, timeout_s: float = 120.0) -> LinkRate:
    def hop(n: int):
        return lambda: ray.get(stage_actor.fetch_probe.remote([projection_actor.payload.remote(n)]), timeout=timeout_s)
    small, large = _best_seconds(hop(PROBE_SMALL)), _best_seconds(hop(PROBE_LARGE))
    return LinkRate(small, (PROBE_LARGE - PROBE_SMALL) / max(large - small, 1e-6))


def measure_rates(projection_actors: list, stage_actors: list, timeout_s: float = 300.0) -> dict:
    """{"host": {...}, "stage": {...}, "link": {...}}: the slowest projection actor and stage."""
    host = [ray.get(a.calibrate.remote(), timeout=timeout_s) for a in projection_actors]
    host_nodes = {w["node_id"] for w in ray.get([a.where.remote() for a in projection_actors], timeout=timeout_s)}
    stage_where = ray.get([a.where.remote() for a in stage_actors], timeout=timeout_s)
    shared = all(w["device"] == "cpu" and w["node_id"] in host_nodes for w in stage_where)
    slowest = lambda ms: max(ms, key=lambda m: m["per_token_s"])  # noqa: E731
    by_stage = [(a, None if shared else ray.get(a.calibrate.remote(), timeout=timeout_s))  # one at a time
                for a in stage_actors]
    stage = [slowest(host)] if shared else [m for _, m in by_stage if m is not None]
    if not host or not stage:
        raise EngramflowError("projection='auto' needs a projection actor and a stage holding wkv to measure")
    holder = stage_actors[0] if shared else next(a for a, m in by_stage if m is not None)
    link = measure_link(projection_actors[0], holder, timeout_s)
    return {"host": slowest(host), "stage": slowest(stage), "shared_compute": shared,
            "link": {"latency_s": link.latency_s, "bytes_per_s": link.bytes_per_s}}


def check_rates(rates) -> dict:
    if rates is None:
        return {}
    if not isinstance(rates, dict) or set(rates) - _KEYS:
        bad = sorted(set(rates) - _KEYS) if isinstance(rates, dict) else type(rates).__name__
        raise EngramflowError(f"placement rates take the keys {sorted(_KEYS)}; got {bad!r}")
    return rates


def build_model(cfg, measured: dict, overrides: dict | None = None) -> PlacementModel:
    """The model from measured rates, any of them replaced by `overrides` (checked)."""
    r = dict(measured) | check_rates(overrides)
    try:
        host, stage = ProjectionRate(**_pick(r["host"])), ProjectionRate(**_pick(r["stage"]))
        link = LinkRate(**r["link"])
    except (KeyError, TypeError) as e:
        raise EngramflowError(f"placement rates are incomplete or malformed ({e}): {r!r}") from None
    kv, rows = bytes_per_token(cfg)
    return PlacementModel(host, stage, link, kv, rows, **{k: r[k] for k in ("margin", "min_gain_s") if k in r})


def _pick(m: dict) -> dict:
    return {"decode_s": m["decode_s"], "per_token_s": m["per_token_s"]}


def make_placement(mode: str, cfg, projection_actors: list, stage_actors: list,
                   rates: dict | None = None) -> ProjectionPlacement:
    """The pipeline's placement: measured (unless every rate is given) only for "auto"."""
    check_projection_mode(mode)
    check_rates(rates)
    lead = {layer: layer / cfg.n_layers for layer in cfg.engram_layer_ids}
    if mode != "auto":
        return ProjectionPlacement(mode, None, lead)
    given = rates or {}
    measured = {} if {"host", "stage", "link"} <= set(given) else measure_rates(projection_actors, stage_actors)
    placement = ProjectionPlacement(mode, build_model(cfg, measured, given), lead)
    placement.measured = measured
    return placement
