"""The one row-store abstraction: every store (host mmap table, hot cache with hits and misses,
SSD, remote RAM through a real TableServer, a tier stack, a store built from a tiers config)
decodes bit-identical rows to a plain numpy decode of the checkpoint's bytes, with the native
gather-decode, and rejects an out-of-range address with the one error from the one place."""
import numpy as np
import pytest
import torch

from engramflow.io.checkpoint import engram_names
from engramflow.kernels import mxfp8, native
from engramflow.memory.tables import EngramTable
from engramflow.tiers import (AddressError, HostMmapSource, HotRowCache, RemoteRamSource, SsdSource, TableServer,
                              TierStack, build_stores)
from test_tiers_fixtures import SECRET

LAYER = 14
SOURCES = ["table", "host", "hot", "ssd", "remote", "stack", "configured"]


@pytest.fixture(scope="module")
def checkpoint_bytes(small_ckpt):
    """The table's bytes read straight from the checkpoint file (no engramflow reader involved)."""
    n = engram_names(LAYER)
    out = []
    for name in (n["embed.weight"], n["embed.scale"]):
        info = small_ckpt.info(name)
        out.append(np.fromfile(info.file, np.uint8, int(np.prod(info.shape)), offset=info.offset).reshape(info.shape))
    return tuple(out)


@pytest.fixture(scope="module")
def server(small_ckpt):
    srv = TableServer.from_checkpoint(small_ckpt, LAYER, SECRET, host="127.0.0.1", max_rows=1000).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def stores(small_ckpt, server, tmp_path_factory):
    table = EngramTable(small_ckpt, LAYER)
    rows = table.rows
    # resident: the first 300 rows (so one-page address sets all hit), the last row, every 7th row
    hot_ids = np.unique(np.concatenate([np.arange(300), [rows - 1], np.arange(0, rows, 7)]))
    remote = RemoteRamSource(*server.address, SECRET, layer=LAYER)
    hot_file = tmp_path_factory.mktemp("hot") / "hot.npy"
    np.save(hot_file, hot_ids)
    configured = build_stores({str(LAYER): {"hot": {"rows_file": str(hot_file)},
                                            "tiers": [{"kind": "ssd", "readers": 2, "policy": "fallback"},
                                                      {"kind": "host"}]}}, small_ckpt, [LAYER])[LAYER]
    out = {
        "table": table,
        "host": HostMmapSource.from_table(table),
        "hot": HotRowCache(HostMmapSource.from_table(table, name="below-hot"), hot_ids),
        "ssd": SsdSource.from_checkpoint(small_ckpt, LAYER, readers=2),
        "remote": remote,
        "stack": TierStack([(RemoteRamSource(*server.address, SECRET, layer=LAYER, name="remote2"), "fallback"),
                            (HostMmapSource.from_table(table), "reject")], LAYER),
        "configured": configured,
    }
    yield out
    for s in out.values():
        s.close()


def reference(codes: np.ndarray, scales: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """Plain numpy MXFP8 decode of rows (codes [N, D], scales [N, D/32]) -> the dtype's bits [N, D]."""
    b = codes.astype(np.int64)
    exp, man = (b >> 3) & 0xF, b & 0x7
    mag = np.where(exp == 0, man / 8 * 2.0**-6, (1 + man / 8) * 2.0 ** (exp - 7))
    vals = np.where(b & 0x80, -mag, mag)
    s = np.repeat(scales.astype(np.int64), 32, axis=-1)
    vals = vals * np.ldexp(1.0, s - 127)
    nan = ((b & 0x7F) == 0x7F) | (s == 255)
    # the checkpoint's scales keep every product inside float32's normal range: this cast is exact
    bits = vals.astype(np.float32).view(np.uint32).astype(np.int64)
    if dtype == torch.float32:
        bits[nan] = 0x7FC00000
        return bits.astype(np.uint32).view(np.int32)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16  # round to nearest even into bfloat16
    bits[nan] = 0x7FC0
    return bits.astype(np.uint16).view(np.int16)


def address_sets(rows: int, columns: int, rng) -> dict[str, np.ndarray]:
    page = 4096 // 32  # rows of 32 code bytes in one 4 KiB page
    return {
        "random": rng.integers(0, rows, (5, columns)),
        "repeats": np.concatenate([np.full((2, columns), rng.integers(rows)),
                                   np.tile(rng.integers(0, rows, 3), columns)[:columns][None]]),
        "one_page": np.stack([rng.permutation(np.arange(page))[:columns] + 2 * page for _ in range(3)]),
        "first_last": np.tile([0, rows - 1], columns)[: 2 * columns].reshape(2, columns),
        "hit_and_miss": np.stack([np.arange(columns) * 7, np.arange(columns) * 7 + 1]),  # hot, then cold
        "one_token_u32": rng.integers(0, rows, (1, columns)).astype(np.uint32),
        "no_tokens": np.zeros((0, columns), np.int64),
    }


@pytest.fixture
def native_only(monkeypatch):
    """Where the native kernel exists, fail any lookup that would take the numpy decode instead
    (an empty fetch has zero strides and may: there is nothing to decode)."""
    if native.library() is not None:
        numpy_decode = mxfp8.gather_decode_numpy

        def refuse(codes, scales, addresses, *a, **k):
            assert addresses.size == 0, "the numpy decode ran: the native gather-decode was skipped"
            return numpy_decode(codes, scales, addresses, *a, **k)
        monkeypatch.setattr(mxfp8, "gather_decode_numpy", refuse)


@pytest.mark.parametrize("source", SOURCES)
def test_every_store_decodes_the_checkpoint_bytes(stores, source, checkpoint_bytes, small_ckpt, rng, native_only):
    store, (codes, scales) = stores[source], checkpoint_bytes
    columns = small_ckpt.config.engram_columns
    for name, addr in address_sets(store.rows, columns, rng).items():
        flat = addr.reshape(-1).astype(np.int64)
        c, s = store.gather(addr)
        assert c.shape == (*addr.shape, store.head_dim) and s.shape == (*addr.shape, store.head_dim // 32), name
        assert np.array_equal(c.reshape(-1, store.head_dim), codes[flat]), name
        assert np.array_equal(s.reshape(-1, store.head_dim // 32), scales[flat]), name
        for dtype in (torch.float32, torch.bfloat16):
            got = store.lookup(addr, dtype)
            assert got.shape == (addr.shape[0], columns * store.head_dim) and got.dtype == dtype, name
            expect = reference(codes[flat], scales[flat], dtype).reshape(addr.shape[0], columns * store.head_dim)
            assert np.array_equal(got.view(torch.int32 if dtype == torch.float32 else torch.int16).numpy(),
                                  expect), (name, dtype)


def test_hot_cache_served_hits_and_misses(stores, small_ckpt, rng):
    hot, columns = stores["hot"], small_ckpt.config.engram_columns
    before = dict(hot.stats.counters)
    for addr in address_sets(hot.rows, columns, rng).values():
        hot.lookup(addr)
    assert hot.stats["hits"] > before["hits"] and hot.stats["misses"] > before["misses"]


@pytest.mark.parametrize("source", SOURCES)
def test_out_of_range_is_the_one_error_from_the_one_place(stores, source, server, small_ckpt):
    store = stores[source]
    rows, columns = store.rows, small_ckpt.config.engram_columns
    requests, range_errors = server.stats["requests"], server.stats["range_errors"]
    for bad in (-1, rows, rows + 12345, -(2**63)):
        addr = np.zeros((2, columns), np.int64)
        addr[1, columns - 1] = bad
        for call in (lambda: store.lookup(addr), lambda: store.gather(addr), lambda: store.gather(addr[1])):
            with pytest.raises(AddressError, match=rf"^layer {LAYER}: address {bad} is outside the table of {rows} rows$") as e:
                call()
            assert e.traceback[-1].name == "check_addresses"
    huge = np.full((1, columns), 2**64 - 1, np.uint64)  # -1 if it were read as int64
    with pytest.raises(AddressError, match=rf"address {2**64 - 1} is outside") as e:
        store.lookup(huge)
    assert e.traceback[-1].name == "check_addresses"
    # rejected before any tier was asked
    assert (server.stats["requests"], server.stats["range_errors"]) == (requests, range_errors)


def test_lookup_checks_shape_and_dtype(stores):
    table = stores["table"]
    with pytest.raises(Exception, match=r"addresses for layer 14 must be integer \[T, 24\]"):
        table.lookup(np.zeros((2, 23), np.int64))
    with pytest.raises(Exception, match=r"layer 14: addresses must be integers"):
        stores["ssd"].gather(np.array([0.5]))
    with pytest.raises(Exception, match="lookup dtype must be bfloat16 or float32"):
        stores["remote"].lookup(np.zeros((1, 24), np.int64), torch.float16)
