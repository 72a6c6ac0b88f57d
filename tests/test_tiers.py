"""Row stores, the hot-row cache, tier stacks and their policies, per-layer config."""
import json
import pickle

import numpy as np
import pytest
import torch

from engramflow.errors import EngramflowError
from engramflow.memory.tables import EngramTable
from engramflow.tiers import HostTier, HotConfig, LayerTiers, RemoteTier, SsdTier, parse_tiers
from engramflow.tiers import (AddressError, HostMmapSource, HotRowCache, Policy, TierError, TierStack,
                              build_stores, load_hot_rows)
from test_tiers_fixtures import Flaky

LAYER = 14


@pytest.fixture(scope="module")
def table(small_ckpt):
    return EngramTable(small_ckpt, LAYER)


@pytest.fixture
def host(table):
    return HostMmapSource.from_table(table)


def _expect(table, ids):
    return np.array(table.codes)[ids], np.array(table.scales)[ids]


def test_host_source_matches_table(table, host, rng):
    ids = rng.integers(0, table.rows, 48)
    codes, scales = host.gather(ids)
    ec, es = _expect(table, ids)
    assert codes.shape == (48, table.head_dim) and np.array_equal(codes, ec) and np.array_equal(scales, es)
    assert host.stats["requests"] == 1 and host.stats["rows"] == 48 and host.stats.latency.count == 1


def test_row_ids_are_bounds_checked(host):
    for bad in (host.rows, -1):
        with pytest.raises(AddressError, match=f"layer 14: address {bad} is outside"):
            host.gather(np.array([0, bad]))
    with pytest.raises(EngramflowError, match="must be integers"):
        host.gather(np.array([0.5]))


def test_store_lookup_equals_engram_table(table, host, rng):
    addr = rng.integers(0, table.rows, (5, 24))
    stack = TierStack([(host, "reject")], LAYER)
    cache = HotRowCache(HostMmapSource.from_table(table), addr.reshape(-1)[::3])
    for st in (host, stack, cache):
        for dtype in (torch.float32, torch.bfloat16):
            assert torch.equal(st.lookup(addr, dtype), table.lookup(addr, dtype))
        c, s = st.gather(addr)
        ec, es = table.gather(addr)
        assert c.shape == (5, 24, table.head_dim) and np.array_equal(c, ec) and np.array_equal(s, es)
        out = torch.empty(5, 24 * table.head_dim)
        assert st.lookup(addr, torch.float32, out=out) is out and torch.equal(out, table.lookup(addr, torch.float32))


def test_hot_cache_bytes_and_exact_accounting(table, host, rng):
    hot_ids = rng.choice(table.rows, 500, replace=False)
    cache = HotRowCache(host, hot_ids)
    lower_rows_after_fill = host.stats["rows"]
    assert lower_rows_after_fill == 500 and len(cache) == 500
    hot_set = set(hot_ids.tolist())
    total_hits = total_miss = 0
    for n in (1, 24, 48, 200):
        ids = np.concatenate([rng.choice(hot_ids, n // 2), rng.integers(0, table.rows, n - n // 2)])
        rng.shuffle(ids)
        codes, scales = cache.gather(ids)
        ec, es = _expect(table, ids)
        assert np.array_equal(codes, ec) and np.array_equal(scales, es)
        hits = sum(int(i) in hot_set for i in ids)
        total_hits, total_miss = total_hits + hits, total_miss + n - hits
        assert cache.stats["hits"] == total_hits and cache.stats["misses"] == total_miss
    # the lower tier was asked for exactly the misses
    assert host.stats["rows"] - lower_rows_after_fill == total_miss


def test_hot_cache_all_hits_never_touch_lower(table, host):
    cache = HotRowCache(host, np.arange(100))
    before = host.stats["requests"]
    c, _ = cache.gather(np.array([0, 99, 5, 5]))
    assert np.array_equal(c, np.array(table.codes)[[0, 99, 5, 5]])
    assert host.stats["requests"] == before and cache.stats["hits"] == 4 and cache.stats["misses"] == 0
    empty = HotRowCache(host, np.array([], np.int64))
    empty.gather(np.array([1, 2]))
    assert empty.stats["misses"] == 2 and empty.stats["hits"] == 0


def test_hot_cache_tensor_path(table, host, rng):
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    addr = rng.integers(0, table.rows, (3, 24))
    hot = np.unique(addr.reshape(-1)[::2])
    for dev in devices:
        cache = HotRowCache(host, hot, device=dev)
        got = cache.lookup(addr, torch.float32, device=dev)
        assert got.device.type == dev and torch.equal(got.cpu(), table.lookup(addr, torch.float32))
        assert cache.stats["hits"] + cache.stats["misses"] == addr.size
        c, s = cache.gather(addr.reshape(-1))  # host bytes from a device cache too
        assert np.array_equal(c, np.array(table.codes)[addr.reshape(-1)])


def test_load_hot_rows_formats(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps({"layers": {"14": {"hot_rows": [[9, 100], [3, 50], [7, 1]]}}}))
    assert load_hot_rows(tmp_path / "a.json", 14, top_k=2).tolist() == [9, 3]
    (tmp_path / "b.json").write_text(json.dumps([5, 6]))
    assert load_hot_rows(tmp_path / "b.json").tolist() == [5, 6]
    np.save(tmp_path / "c.npy", np.array([[4, 10], [2, 3]]))
    assert load_hot_rows(tmp_path / "c.npy").tolist() == [4, 2]
    (tmp_path / "d.txt").write_text("# row count\n11 5\n12,4\n")
    assert load_hot_rows(tmp_path / "d.txt").tolist() == [11, 12]
    with pytest.raises(EngramflowError, match="no hot rows for layer 1"):
        load_hot_rows(tmp_path / "a.json", 1)
    with pytest.raises(EngramflowError, match="not found"):
        load_hot_rows(tmp_path / "missing.npy")


def test_policy_fallback_gives_same_bytes(table, host, rng):
    down = Flaky(host, fail=10**9)
    stack = TierStack([(down, "fallback"), (HostMmapSource.from_table(table), "reject")], LAYER)
    ids = rng.integers(0, table.rows, 48)
    for _ in range(3):
        c, s = stack.gather(ids)
        assert np.array_equal(c, _expect(table, ids)[0]) and np.array_equal(s, _expect(table, ids)[1])
    assert down.stats["fallbacks"] == 3 and down.stats["errors"] == 3
    assert stack.tier_stats()["host"]["requests"] == 3


def test_policy_retry_recovers_and_is_bounded(table, host, rng):
    ids = rng.integers(0, table.rows, 24)
    flaky = Flaky(host, fail=2)
    stack = TierStack([(flaky, Policy("retry", retries=2, backoff_s=0.0001))], LAYER)
    assert np.array_equal(stack.gather(ids)[0], _expect(table, ids)[0])
    assert flaky.calls == 3 and flaky.stats["retries"] == 2
    flaky.fail = 5
    with pytest.raises(TierError, match=r"layer 14 tier 'flaky' failed after 3 attempt\(s\) \(policy retry\)"):
        stack.gather(ids)
    assert flaky.calls == 6 and flaky.stats["rejects"] == 1
    # retry, then fall back
    flaky.fail = 5
    stack2 = TierStack([(flaky, {"mode": "retry", "retries": 1, "backoff_s": 0.0, "then": "fallback"}),
                        (host, "reject")], LAYER)
    assert np.array_equal(stack2.gather(ids)[1], _expect(table, ids)[1])
    assert flaky.stats["fallbacks"] == 1


def test_policy_reject_and_validation(host):
    stack = TierStack([(Flaky(host, fail=1), "reject"), (host, "reject")], LAYER)
    with pytest.raises(TierError, match="policy reject.*flaky is down"):
        stack.gather(np.array([1]))
    assert stack.gather(np.array([1]))[0].shape == (1, host.head_dim)  # the tier came back
    with pytest.raises(EngramflowError, match="no tier below it"):
        TierStack([(host, "fallback")])
    with pytest.raises(EngramflowError, match="must be one of"):
        Policy("ignore")
    with pytest.raises(EngramflowError, match="unknown tier policy key"):
        Policy.parse({"mode": "retry", "tries": 3})
    with pytest.raises(AddressError, match="address -3"):  # bad ids never reach a policy
        stack.gather(np.array([-3]))


def test_build_stores_from_config(small_ckpt, table, tmp_path, rng):
    (tmp_path / "hot.json").write_text(json.dumps({"layers": {"14": {"rows": list(range(50))}}}))
    cfg = {"14": {"hot": {"rows_file": str(tmp_path / "hot.json"), "top_k": 20},
                  "tiers": [{"kind": "ssd", "readers": 2, "io": "auto", "policy": "fallback"},
                            {"kind": "host"}]}}
    stores = build_stores(cfg, small_ckpt)
    assert set(stores) == {1, 14} and isinstance(stores[14], HotRowCache) and len(stores[14]) == 20
    assert isinstance(stores[1], EngramTable)  # no entry: the plain host table
    ids = np.concatenate([np.arange(10), rng.integers(0, table.rows, 38)])
    c, s = stores[14].gather(ids)
    assert np.array_equal(c, _expect(table, ids)[0]) and np.array_equal(s, _expect(table, ids)[1])
    assert stores[14].stats["hits"] >= 10
    addr = ids[:24][None]
    assert torch.equal(stores[14].lookup(addr), table.lookup(addr))
    with pytest.raises(EngramflowError, match=r"must be integer \[T, 24\]"):
        stores[14].lookup(np.zeros((1, 23), np.int64))
    for src in stores.values():
        src.close()
    with pytest.raises(EngramflowError, match="names layer '3'"):
        build_stores({"3": {}}, small_ckpt)
    with pytest.raises(EngramflowError, match="kind one of host, ssd, remote"):
        build_stores({"default": {"tiers": [{"kind": "tape"}]}}, small_ckpt)
    with pytest.raises(EngramflowError, match=r"unknown key\(s\) \['readerz'\]"):
        build_stores({"default": {"tiers": [{"kind": "ssd", "readerz": 3}]}}, small_ckpt)


def test_parse_tiers_typed_and_errors_name_the_key(tmp_path):
    secret, hot = tmp_path / "secret", tmp_path / "hot.npy"
    secret.write_bytes(b"x" * 32)
    np.save(hot, np.arange(5))
    raw = {"14": {"hot": {"rows_file": str(hot), "top_k": 3},
                  "tiers": [{"kind": "remote", "port": 7411, "secret_file": str(secret), "policy": "fallback"},
                            {"kind": "ssd", "readers": 2, "policy": {"mode": "retry", "retries": 1, "then": "fallback"}},
                            {"kind": "host"}]},
           "default": {}}
    cfg = parse_tiers(raw, [1, 14])
    assert set(cfg.layers) == {1, 14} and cfg.layers[1] == LayerTiers()
    spec = cfg.layers[14]
    assert spec.hot == HotConfig(rows_file=str(hot), top_k=3)
    assert [type(t) for t in spec.tiers] == [RemoteTier, SsdTier, HostTier]
    assert spec.tiers[0].policy == Policy("fallback") and spec.tiers[0].name == "remote"
    assert spec.tiers[1].policy == Policy("retry", retries=1, then="fallback") and spec.tiers[2].policy.mode == "reject"
    assert pickle.loads(pickle.dumps(cfg)) == cfg and parse_tiers(cfg, [1, 14]) is cfg
    assert not parse_tiers(None, [1, 14]) and not parse_tiers({}, [1, 14])

    def bad(raw, match, **kw):
        with pytest.raises(EngramflowError, match=match):
            parse_tiers(raw, [1, 14], **kw)

    bad({"14": {"tiers": [{"kind": "host", "policy": "ignore"}]}},
        r"^tiers\['14'\]\.tiers\[0\]\.policy: tier policy must be one of")
    bad({"default": {"tiers": [{"kind": "ssd", "readers": 0}, {"kind": "host"}]}},
        r"^tiers\['default'\]\.tiers\[0\]\.readers: must be an integer in \[1, 256\], got 0")
    bad({14: {"tiers": [{"kind": "ssd", "io": "fast"}]}}, r"^tiers\[14\]\.tiers\[0\]\.io: must be one of auto")
    bad({"14": {"tiers": [{"kind": "remote", "port": "7411", "secret_file": str(secret)}]}},
        r"tiers\['14'\]\.tiers\[0\]\.port: must be an integer")
    bad({"14": {"tiers": [{"kind": "remote", "port": 1}]}}, r"tiers\['14'\]\.tiers\[0\]: a remote tier needs 'secret_file'")
    bad({"14": {"tiers": [{"kind": "remote", "port": 1, "secret_file": str(tmp_path / "nope")}]}},
        r"tiers\['14'\]\.tiers\[0\]\.secret_file: no such file")
    parse_tiers({"14": {"tiers": [{"kind": "remote", "port": 1, "secret_file": str(tmp_path / "nope")}]}},
                [1, 14], check_files=False)  # files on the actors' machines only
    bad({"14": {"tiers": [{"kind": "host", "policy": {"mode": "retry", "backoff_s": "1ms"}}]}},
        r"tiers\['14'\]\.tiers\[0\]\.policy: tier policy backoff_s must be a number")
    bad({"14": {"tiers": [{"kind": "host", "policy": "fallback"}]}},
        r"tiers\['14'\]\.tiers\[0\]\.policy: the last tier 'host' has policy 'fallback'.*no tier below")
    bad({"14": {"hot": {"rows_file": str(hot), "top_k": -1}}}, r"tiers\['14'\]\.hot\.top_k: must be an integer")
    bad({"14": {"hot": {"rows_file": str(hot), "topk": 1}}}, r"tiers\['14'\]\.hot: unknown key\(s\) \['topk'\]")
    bad({"14": {"hot": {"top_k": 1}}}, r"tiers\['14'\]\.hot: the hot cache needs 'rows_file'")
    bad({"default": {"hot": {"rows_file": str(tmp_path / "missing.npy")}}},
        r"tiers\['default'\]\.hot\.rows_file: no such file")
    bad({"14": {"tier": []}}, r"tiers\['14'\]: unknown key\(s\) \['tier'\]")
    bad({"14": {"tiers": {"kind": "host"}}}, r"tiers\['14'\]\.tiers: must be a list")
    bad({"14": {}, 14: {}}, "layer 14 is given twice")
    bad([{"kind": "host"}], "tiers: must be a mapping")


def test_pipeline_with_tiers_matches_engine(ray_session, tiny_ckpt, tmp_path):
    from engramflow.pipeline.engine import Engine
    from engramflow.pipeline.pipeline import Pipeline

    np.save(tmp_path / "hot.npy", np.arange(0, 4000, 3))
    tiers = {"14": {"hot": {"rows_file": str(tmp_path / "hot.npy"), "top_k": 500},
                    "tiers": [{"kind": "ssd", "readers": 2, "policy": "fallback"}, {"kind": "host"}]},
             "default": {"tiers": [{"kind": "ssd", "readers": 1, "policy": {"mode": "retry", "retries": 1}}]}}
    prompt = "Engram memory lets a model look things up"
    engine = Engine(tiny_ckpt, tiers=tiers)
    try:
        (ref,) = engine.generate([prompt], max_new_tokens=4)
    finally:
        engine.shutdown()
    pipe = Pipeline.launch(tiny_ckpt, stages=1, tiers=tiers)
    try:
        (got,) = pipe.generate([prompt], max_new_tokens=4)
    finally:
        pipe.shutdown()
    assert got.tokens == ref.tokens
