"""SSD tier: every engine, read mode and scale placement returns exactly a plain gather's bytes;
deduplication and page coalescing are exact on random and adversarial address sets; a failed
or short read names the row and goes through the tier policy."""
import os
import shutil

import numpy as np
import pytest

from engramflow.errors import EngramflowError
from engramflow.io.batch_read import AlignedBuffer, BatchReader, open_for_reads
from engramflow.memory.tables import EngramTable
from engramflow.tiers import HostMmapSource, SsdSource, SsdTier, TierError, TierStack
from engramflow.tiers.read_plan import PAGE, plan_reads
from engramflow.tiers.ssd import gather_many
from test_tiers_fixtures import small_checkpoint


def engines():
    """The engines that work here: threads always; uring when the library builds and the kernel grants a ring."""
    out = ["threads"]
    try:
        BatchReader(4, "uring").close()
        out.append("uring")
    except EngramflowError:
        pass
    return out


ENGINES = engines()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return small_checkpoint(tmp_path_factory.mktemp("ssd"))


def write_table(path, rows=3000, head=4093, seed=3):
    """head_dim 256 rows at deliberately unaligned offsets, so rows straddle 4 KiB pages."""
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 256, (rows, 256), dtype=np.uint8)
    scales = rng.integers(0, 256, (rows, 8), dtype=np.uint8)
    path.write_bytes(b"x" * head + codes.tobytes() + b"yyy" + scales.tobytes())
    return path, head, head + codes.nbytes + 3, codes, scales


@pytest.fixture(scope="module")
def raw_table(tmp_path_factory):
    return write_table(tmp_path_factory.mktemp("raw") / "table.bin")


@pytest.fixture(scope="module")
def aligned_table(tmp_path_factory):
    """Codes at a page boundary: 16 rows per page exactly."""
    return write_table(tmp_path_factory.mktemp("aligned") / "table.bin", rows=2048, head=8192, seed=4)


def open_src(table, **kw):
    path, co, so, codes, _ = table
    return SsdSource(path, co, so, codes.shape[0], codes.shape[1], **kw)


def adversarial(rows: int, rng) -> dict:
    page_rows = PAGE // 256
    return {"random": rng.integers(0, rows, 48),
            "all equal": np.full(48, rng.integers(0, rows)),
            "one page": np.repeat(np.arange(page_rows), 3),
            "page boundaries": np.array([15, 16, 31, 32, 47, 48, 63, 64, 0, rows - 1, rows - 2, 15, 16]),
            "first and last": np.array([0, rows - 1] * 5),
            "every row": np.arange(rows),
            "one": np.array([7])}


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("mode", ["auto", "direct", "dontneed", "buffered"])
@pytest.mark.parametrize("scales", ["resident", "read"])
def test_ssd_bytes_identical(raw_table, engine, mode, scales, rng):
    try:
        src = open_src(raw_table, mode=mode, engine=engine, scales=scales, queue_depth=8)
    except EngramflowError as e:
        pytest.skip(f"{mode} reads unsupported here: {e}")
    _, _, _, codes, table_scales = raw_table
    with src:
        assert (mode == "auto" or src.mode == mode) and src.engine == engine
        for name, ids in adversarial(codes.shape[0], rng).items():
            c, s = src.gather(ids)
            assert np.array_equal(c, codes[ids]) and np.array_equal(s, table_scales[ids]), name
        io = src.io_stats()
        assert src.read_latency.count == io["reads"]  # one latency sample per device read


@pytest.mark.parametrize("engine", ENGINES)
def test_dedup_and_coalescing_counts(aligned_table, engine, rng):
    _, _, _, codes, table_scales = aligned_table
    with open_src(aligned_table, engine=engine) as src:
        def reads_for(ids):
            before = src.io_stats()
            c, s = src.gather(ids)
            assert np.array_equal(c, codes[ids]) and np.array_equal(s, table_scales[ids])
            after = src.io_stats()
            return after["reads"] - before["reads"], after["distinct_rows"] - before["distinct_rows"]

        assert reads_for(np.full(48, 1234)) == (1, 1)               # all equal: one read
        assert reads_for(np.repeat(np.arange(32, 48), 3)) == (1, 16)  # one page, 16 rows: one read
        assert reads_for(np.array([15, 16])) == (2, 2)               # neighbours across a page boundary
        assert reads_for(np.arange(0, 2048, 16)) == (128, 128)       # one row per page
        ids = rng.integers(0, codes.shape[0], 500)
        assert reads_for(ids) == (np.unique(ids // 16).size, np.unique(ids).size)
        io = src.io_stats()
        assert io["ids"] == 48 + 48 + 2 + 128 + 500 and io["dedup_ratio"] > 1


def test_read_plan_covers_every_row_once(rng):
    for base in (0, 1, 4093, 4096, 8190):
        for ids in adversarial(5000, rng).values():
            plan = plan_reads(ids, base, 256)
            assert np.array_equal(plan.rows, np.unique(ids)) and np.array_equal(plan.rows[plan.inverse], ids)
            assert (plan.offsets % PAGE == 0).all() and (plan.lengths % PAGE == 0).all() and (plan.lengths > 0).all()
            ends = plan.offsets + plan.lengths
            assert (plan.offsets[1:] >= ends[:-1]).all()  # reads ascending, no page read twice
            start = base + plan.rows * 256
            read = plan.row_read
            assert (start >= plan.offsets[read]).all() and (start + 256 <= ends[read]).all()
            assert np.array_equal(plan.row_pos, plan.buffer_offsets[read] + start - plan.offsets[read])
            assert (plan.needed <= plan.lengths).all()
            # fewest reads: a read only ever joins rows whose pages touch
            pages = set()
            for s in start.tolist():
                pages.update(range(s // PAGE, (s + 255) // PAGE + 1))
            assert plan.lengths.sum() // PAGE == len(pages)


def test_gather_many_submits_layers_together(ckpt, rng):
    stores = {l: SsdSource.from_checkpoint(ckpt, l, queue_depth=16) for l in ckpt.config.engram_layer_ids}
    hosts = {l: HostMmapSource.from_table(EngramTable(ckpt, l)) for l in stores}
    try:
        ids = {l: rng.integers(0, s.rows, 24 * 3) for l, s in stores.items()}  # 3 sessions' rows per layer
        got = gather_many([(s, ids[l]) for l, s in stores.items()])
        for (l, s), (c, sc) in zip(stores.items(), got):
            hc, hs = hosts[l].gather(ids[l])
            assert np.array_equal(c, hc) and np.array_equal(sc, hs)
    finally:
        for s in stores.values():
            s.close()


def test_ssd_from_checkpoint_matches_host(ckpt, rng):
    table = EngramTable(ckpt, 1)
    host = HostMmapSource.from_table(table)
    for scales in ("resident", "read"):
        with SsdSource.from_checkpoint(ckpt, 1, scales=scales) as ssd:
            for n in (24, 48):
                ids = rng.integers(0, table.rows, n)
                for a, b in zip(ssd.gather(ids), host.gather(ids)):
                    assert np.array_equal(a, b)
            a = rng.integers(0, table.rows, (5, ckpt.config.engram_columns))
            assert ssd.lookup(a).equal(host.lookup(a))


@pytest.fixture
def doomed_table(tmp_path, raw_table):
    """A private copy of the raw table: tests truncate or replace it."""
    path = tmp_path / "table.bin"
    shutil.copyfile(raw_table[0], path)
    return (path, *raw_table[1:])


@pytest.mark.parametrize("engine", ENGINES)
def test_short_read_names_the_row_and_follows_the_policy(doomed_table, engine):
    path, co, _, codes, table_scales = doomed_table
    src = open_src(doomed_table, engine=engine)
    host = HostMmapSource(codes, table_scales, name="host")
    with open(path, "r+b") as f:
        f.truncate(co + 2000 * 256 + 100)  # rows from 2000 on are gone (the scales stay resident)
    ids = np.array([5, 2500, 6])
    with pytest.raises(TierError, match=r"SSD read of row 2500 \(bytes \d+\+\d+ of .*\) came back short"):
        src.gather(ids)
    assert np.array_equal(src.gather([5, 6])[0], codes[[5, 6]])  # rows before the cut still read
    fallback = TierStack([(src, "fallback"), (host, "reject")], layer=3)
    c, s = fallback.gather(ids)
    assert np.array_equal(c, codes[ids]) and np.array_equal(s, table_scales[ids])
    assert src.stats["fallbacks"] == 1 and src.stats["errors"] >= 1
    reject = TierStack([(src, "reject")], layer=3)
    with pytest.raises(TierError, match=r"layer 3 tier 'ssd' failed .*row 2500"):
        reject.gather(ids)
    src.close()


@pytest.mark.parametrize("engine", ENGINES)
def test_io_error_names_the_row(doomed_table, tmp_path, engine):
    src = open_src(doomed_table, engine=engine, mode="buffered")
    # the tier's descriptor now names a directory: every read fails with EISDIR (a real error from the kernel)
    d = os.open(tmp_path, os.O_RDONLY)
    os.dup2(d, src._fd)
    os.close(d)
    with pytest.raises(TierError, match=r"SSD read of row 17 .* failed: Is a directory \(errno 21\) \(2 of 2 reads"):
        src.gather(np.array([17, 99, 17]))
    codes, table_scales = doomed_table[3], doomed_table[4]
    ids = np.array([99, 17, 99])
    c, s = TierStack([(src, "fallback"), (HostMmapSource(codes, table_scales), "reject")], layer=1).gather(ids)
    assert np.array_equal(c, codes[ids]) and np.array_equal(s, table_scales[ids])
    with pytest.raises(TierError, match=r"layer 1 tier 'ssd' failed after 2 attempt\(s\) \(policy retry\): .*row 17"):
        TierStack([(src, {"mode": "retry", "retries": 1, "backoff_s": 0})], layer=1).gather(ids)
    src.close()


@pytest.mark.parametrize("engine", ENGINES)
def test_batch_reader_reports_each_read(raw_table, engine):
    path = raw_table[0]
    fd, _, _ = open_for_reads(path, "buffered")
    buf = AlignedBuffer(3 * PAGE)
    reader = BatchReader(2, engine)
    try:
        addrs = buf.address + np.arange(3, dtype=np.uint64) * PAGE
        res, lat = reader.read([fd, 10_000, fd], [0, 0, PAGE], PAGE, addrs)  # fd 10000 is not open
        assert res[0] == PAGE and res[2] == PAGE and res[1] < 0 and (lat >= 0).all()
        assert bytes(buf.array[:PAGE]) == path.read_bytes()[:PAGE]
        assert bytes(buf.array[2 * PAGE:3 * PAGE]) == path.read_bytes()[PAGE:2 * PAGE]
    finally:
        reader.close()
        os.close(fd)


def test_o_direct_fallback_on_tmpfs(raw_table):
    """tmpfs takes the O_DIRECT flag but not its reads (or refuses the open): auto falls back
    and says why; direct is refused with the reason."""
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm here")
    path = f"/dev/shm/engramflow-test-{os.getpid()}.bin"
    shutil.copyfile(raw_table[0], path)
    try:
        try:
            fd, mode, why = open_for_reads(path, "auto")
        except EngramflowError as e:
            pytest.skip(f"cannot read /dev/shm here: {e}")
        os.close(fd)
        if mode == "direct":
            pytest.skip("this tmpfs supports O_DIRECT")
        assert mode == "dontneed" and "direct" in why.lower()
        with pytest.raises(EngramflowError, match="direct"):
            open_for_reads(path, "direct")
        with open_src((path, *raw_table[1:])) as src:
            ids = np.array([1, 2, 2999])
            assert np.array_equal(src.gather(ids)[0], raw_table[3][ids]) and src.mode == "dontneed"
    finally:
        os.unlink(path)


def test_forced_engine_fallback(raw_table, monkeypatch):
    monkeypatch.setenv("ENGRAMFLOW_NO_URING", "1")
    with open_src(raw_table, engine="auto") as src:
        assert src.engine == "threads" and "ENGRAMFLOW_NO_URING" in src.reader.engine_reason
        assert np.array_equal(src.gather([3, 4])[0], raw_table[3][[3, 4]])
    with pytest.raises(EngramflowError, match="io_uring engine unavailable"):
        open_src(raw_table, engine="uring")


def test_ssd_rejects_bad_setup(raw_table):
    path, co, so, codes, _ = raw_table
    with pytest.raises(EngramflowError, match="run past the file"):
        SsdSource(path, co, so, codes.shape[0] + 100, 256)
    with pytest.raises(EngramflowError, match="read mode must be one of"):
        SsdSource(path, co, so, 10, 256, mode="fast")
    with pytest.raises(EngramflowError, match="readers must be"):
        SsdSource(path, co, so, 10, 256, readers=0)
    with pytest.raises(EngramflowError, match="queue depth must be an integer in \\[1, 4096\\], got 0"):
        SsdSource(path, co, so, 10, 256, queue_depth=0)
    with pytest.raises(EngramflowError, match="engine must be one of auto, uring, threads, got 'spdk'"):
        SsdSource(path, co, so, 10, 256, engine="spdk")
    with pytest.raises(EngramflowError, match="scales must be one of resident, read, got 'gpu'"):
        SsdSource(path, co, so, 10, 256, scales="gpu")
    with pytest.raises(EngramflowError, match="scales='read' needs codes and scales in one file"):
        SsdSource(path, co, 0, 10, 256, scales="read", scales_path=__file__)
    for kw, msg in (({"queue_depth": 0}, "queue_depth: must be"), ({"engine": "x"}, "engine: must be one of"),
                    ({"scales": "x"}, "scales: must be one of")):
        with pytest.raises(EngramflowError, match=msg):
            SsdTier(**kw)


def test_native_io_builds_and_refuses_bad_libraries(tmp_path, monkeypatch):
    """setup.py's way (module loaded by path, standard library only) builds a loadable library;
    a missing or foreign library is refused with the reason, and readers fall back."""
    import importlib.util

    from engramflow.kernels import native_io
    spec = importlib.util.spec_from_file_location("_by_path", native_io.__file__)
    by_path = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(by_path)
    if by_path.nb.compiler() is None:
        pytest.skip("no C compiler here")
    ok, log = by_path.build_library(tmp_path / "io.so")
    assert ok, log
    lib, why = native_io._open(tmp_path / "io.so", check_source=True)
    assert lib is not None and lib.efio_abi_version() == native_io.ABI_VERSION, why
    monkeypatch.setenv("ENGRAMFLOW_NATIVE_IO_LIB", str(tmp_path / "missing.so"))
    lib, why = native_io._load()
    assert lib is None and "missing.so" in why
    monkeypatch.delenv("ENGRAMFLOW_NATIVE_IO_LIB")
    monkeypatch.setenv("ENGRAMFLOW_NO_NATIVE", "1")
    assert native_io._load() == (None, "disabled by ENGRAMFLOW_NO_NATIVE=1")
