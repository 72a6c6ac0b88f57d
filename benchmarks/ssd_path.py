"""The SSD path of bench_tiers.py: the device's own random-read curve, then the SSD tier's cold
48-row fetch, a cold 4K-token prefill and the deduplication ratio on real text, all on the
same file in the same run (so the ratios compare like with like)."""
from __future__ import annotations

import os
import time

import numpy as np

from engramflow.io.batch_read import PAGE, AlignedBuffer, BatchReader, open_for_reads
from engramflow.tiers import SsdSource
from engramflow.tiers.ssd import gather_many

DEPTHS = (1, 2, 4, 8, 16, 32, 64)


def device_curve(path, engine: str, reads: int, rng, depths=DEPTHS) -> list[dict]:
    """4 KiB random O_DIRECT reads at each queue depth: IOPS and per-read latency."""
    fd, mode, why = open_for_reads(path, "auto")
    pages = os.path.getsize(path) // PAGE
    out = []
    try:
        warm = BatchReader(8, engine)  # first reads of a run pay start-up costs (host side, ring): not counted
        buf = AlignedBuffer(500 * PAGE)
        warm.read(fd, rng.integers(0, pages, 500) * PAGE, PAGE, buf.address + np.arange(500, dtype=np.uint64) * PAGE)
        warm.close()
        for qd in depths:
            reader = BatchReader(qd, engine)
            n = max(reads // 4, 200) if qd == 1 else reads  # depth 1 is slow: fewer reads
            buf = AlignedBuffer(n * PAGE)
            offsets = rng.integers(0, pages, n) * PAGE
            addrs = buf.address + np.arange(n, dtype=np.uint64) * PAGE
            t = time.perf_counter()
            res, lat = reader.read(fd, offsets, PAGE, addrs)
            dt = time.perf_counter() - t
            reader.close()
            if (res != PAGE).any():
                raise RuntimeError(f"device probe: {int((res != PAGE).sum())} reads failed")
            p50, p99 = np.percentile(lat, [50, 99]) / 1e3
            out.append({"engine": reader.engine, "mode": mode, "qd": qd, "reads": n, "iops": n / dt,
                        "p50_us": p50, "p99_us": p99})
    finally:
        os.close(fd)
    return out


def fetch48(srcs: list[SsdSource], count: int, rng) -> np.ndarray:
    """Seconds per cold step fetch: 24 random rows of each of the two tables, one batch."""
    for _ in range(10):  # warm the code paths (rows are random: the device stays cold)
        gather_many([(s, rng.integers(0, s.rows, 24)) for s in srcs])
    out = np.empty(count)
    for i in range(count):
        reqs = [(s, rng.integers(0, s.rows, 24)) for s in srcs]
        t = time.perf_counter()
        gather_many(reqs)
        out[i] = time.perf_counter() - t
    return out


def real_text_addresses(tokens: int) -> tuple[np.ndarray, dict]:
    """V4.1 row addresses [T, layers, 24] of the first `tokens` tokens of the bundled real-text
    dataset (Python's docs), as one prompt, with the exact per-layer dedup ratio."""
    from engramflow.data.datasets import make_table
    from engramflow.io.presets import preset
    from engramflow.io.token_map import TokenMap, load_tokenizer
    from engramflow.memory.history import SessionHistory

    tok = load_tokenizer()
    ids: list[int] = []
    for text in make_table().column("text").to_pylist():
        ids.extend(tok.encode(text, add_special_tokens=False).ids)
        if len(ids) >= tokens:
            break
    cfg = preset("deepseek-v4.1-flash")
    history = SessionHistory.from_config(cfg, TokenMap.default())
    s = history.open()
    addr = history.append(s, ids[:tokens])
    dedup = {str(l): addr[:, i].size / np.unique(addr[:, i]).size for i, l in enumerate(cfg.engram_layer_ids)}
    dedup["both"] = addr.size / sum(np.unique(addr[:, i]).size for i in range(addr.shape[1]))
    return addr, dedup


def prefill(srcs: list[SsdSource], addr: np.ndarray, chunk: int) -> dict:
    """A cold prefill's row reads: chunks of `chunk` tokens, both layers in one batch per chunk.
    Real-text addresses are folded into the (smaller) tables by modulo, keeping their repeats."""
    before = [s.io_stats() for s in srcs]
    t = time.perf_counter()
    for c in range(0, addr.shape[0], chunk):
        gather_many([(s, addr[c:c + chunk, i].reshape(-1) % s.rows) for i, s in enumerate(srcs)])
    dt = time.perf_counter() - t
    after = [s.io_stats() for s in srcs]
    d = {k: sum(a[k] - b[k] for a, b in zip(after, before)) for k in ("ids", "distinct_rows", "reads", "pages")}
    return d | {"tokens": int(addr.shape[0]), "chunk_tokens": chunk, "seconds": dt,
                "unique_reads_per_s": d["reads"] / dt, "rows_per_s": d["ids"] / dt,
                "dedup_ratio": d["ids"] / d["distinct_rows"], "rows_per_read": d["distinct_rows"] / d["reads"]}
