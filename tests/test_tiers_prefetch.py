"""Prefill pipelining over the SSD tier: the next chunk is read while this one is consumed, and
the projected K/V equal a one-shot lookup + projection over the host table, bit for bit."""
import time

import numpy as np

from engramflow.model.engram_memory import EngramMemory
from engramflow.tiers import SsdSource
from engramflow.tiers.prefetch import chunk_bounds, is_io_bound, pipelined_lookup
from test_tiers_fixtures import small_checkpoint

SSD = {"default": {"tiers": [{"kind": "ssd", "queue_depth": 16, "policy": "fallback"}, {"kind": "host"}]}}


def test_next_chunk_is_read_while_this_one_is_held(tmp_path, rng):
    ckpt = small_checkpoint(tmp_path)
    cols = ckpt.config.engram_columns
    with SsdSource.from_checkpoint(ckpt, 1) as src:
        a = rng.integers(0, src.rows, (23, cols))
        got = []
        for i, (s, e, rows) in enumerate(pipelined_lookup(src, a, chunk_tokens=5)):
            if i == 0:  # without asking for more, chunk 1's reads happen
                deadline = time.monotonic() + 10
                while src.io_stats()["batches"] < 2 and time.monotonic() < deadline:
                    time.sleep(0.001)
                assert src.io_stats()["batches"] == 2
            assert rows.equal(src.lookup(a[s:e]))
            got.append((s, e))
        assert got == [(0, 5), (5, 10), (10, 15), (15, 20), (20, 23)]


def test_pipelined_prefill_projection_equals_host(tmp_path, rng):
    ckpt = small_checkpoint(tmp_path)
    host, ssd = EngramMemory(ckpt), EngramMemory(ckpt, tiers=SSD)
    ssd.prefetch_tokens = 70
    try:
        for l in ckpt.config.engram_layer_ids:
            assert is_io_bound(ssd.tables[l]) and not is_io_bound(host.tables[l])
            small = ssd.projections[l].decode_max_tokens  # chunks stay on the GEMM path (64 here)
            assert small < 70
            src = ssd.tables[l].levels[0][0]
            for t, chunks in ((300, 4), (70, 1), (141, 2), (5, 1)):  # 300: 4 x 70 + 20, the 20 joins the last
                a = rng.integers(0, host.tables[l].rows, (t, ckpt.config.engram_columns))
                before = src.io_stats()["batches"]
                (k0, v0), (k1, v1) = host.project(l, a), ssd.project(l, a)
                assert k0.equal(k1) and v0.equal(v1)
                assert src.io_stats()["batches"] - before == chunks
    finally:
        host.close()
        ssd.close()


def test_chunk_bounds():
    assert chunk_bounds(300, 70, 64) == [(0, 70), (70, 140), (140, 210), (210, 300)]
    assert chunk_bounds(300, 70) == [(0, 70), (70, 140), (140, 210), (210, 280), (280, 300)]
    assert chunk_bounds(70, 70, 64) == [(0, 70)] and chunk_bounds(0, 70) == []


def test_project_all_reads_layers_together_and_equals_per_layer(tmp_path, rng):
    ckpt = small_checkpoint(tmp_path)
    host, ssd = EngramMemory(ckpt), EngramMemory(ckpt, tiers=SSD)
    try:
        ssd.prefetch_tokens = 70
        for t in (3, 40, 200):  # decode-sized (lookups started together) and prefill-sized (pipelined chunks)
            rows = min(s.rows for s in host.tables.values())
            a = rng.integers(0, rows, (t, len(ckpt.config.engram_layer_ids), ckpt.config.engram_columns))
            want = {l: host.project(l, a) for l in host.layer_ids}
            for mem in (host, ssd):
                got = mem.project_all(a)
                assert sorted(got) == sorted(want)
                for l, (k, v) in got.items():
                    assert k.equal(want[l][0]) and v.equal(want[l][1])
    finally:
        host.close()
        ssd.close()
