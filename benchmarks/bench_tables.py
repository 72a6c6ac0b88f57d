"""Engram table reads: hot gather+decode per token (48 rows, both layers) against torch's
float8 cast, and cold random row reads (page cache dropped with POSIX_FADV_DONTNEED) as
p50/p99/p99.9 latency with 1 and 4 readers, 264-byte rows vs whole 4 KiB pages."""
from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import numpy as np
import torch

from common import median, parser, print_table, timed, write_json
from engramflow.memory.history import SessionHistory
from engramflow.memory.tables import EngramTables
from engramflow.io.checkpoint import Checkpoint, engram_names
from engramflow.model.synth import make_checkpoint

ROW = 264


def ensure_checkpoint(path: Path, quick: bool) -> Checkpoint:
    if not (path / "config.json").is_file():
        make_checkpoint("v41-engram", path, engram_vocab_size=40_000 if quick else None)
    return Checkpoint(path)


def hot_decode(ckpt: Checkpoint, n_tokens: int) -> list[dict]:
    tables = EngramTables(ckpt)
    tables.warmup(progress=False)
    history = SessionHistory.from_config(ckpt.config)
    ids = np.random.default_rng(1).integers(0, ckpt.config.vocab_size, n_tokens)
    addr = history.append(history.open(), ids)  # [T, 2, 24]
    layers = list(tables.layers.values())
    outs = [torch.empty(1, 24 * t.head_dim, dtype=torch.bfloat16) for t in layers]

    def ours(t):
        for i, tab in enumerate(layers):
            tab.lookup(addr[t: t + 1, i], torch.bfloat16, out=outs[i])

    def torch_cast(t):
        for i, tab in enumerate(layers):
            codes, scales = tab.gather(addr[t: t + 1, i])
            vals = torch.from_numpy(codes).view(torch.float8_e4m3fn).float().view(24, -1, 32)
            s = torch.from_numpy(scales.astype(np.float32)).sub_(127).exp2_().unsqueeze(-1)
            (vals * s).bfloat16()

    rows = []
    for name, fn in (("engramflow lookup (bf16)", ours), ("torch float8 cast", torch_cast)):
        ts = [timed(lambda t=t: fn(t), 1)[0] for t in range(n_tokens)]
        rows.append({"case": name, "us_per_token_48_rows": median(ts) * 1e6})
    for r in rows:
        r["speedup_vs_cast"] = rows[1]["us_per_token_48_rows"] / r["us_per_token_48_rows"]
    return rows


def cold_reads(ckpt: Checkpoint, readers: int, size: int, n_per_reader: int) -> dict:
    info = ckpt.info(engram_names(ckpt.config.engram_layer_ids[-1])["embed.weight"])
    fd = os.open(info.file, os.O_RDONLY)
    try:
        os.fsync(fd)  # dirty pages cannot be dropped
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # drop this file from the page cache
        rows = info.shape[0]
        lat: list[list[int]] = [[] for _ in range(readers)]

        def reader(k: int) -> None:
            # fresh rows for every configuration: a page read by an earlier one may still sit
            # in the hypervisor's cache, which DONTNEED cannot reach
            rng = np.random.default_rng([readers, size, k])
            for r in rng.integers(0, rows, n_per_reader):
                off = info.offset + int(r) * info.shape[1]
                if size > ROW:
                    off -= off % size  # the whole page holding the row
                t = time.perf_counter_ns()
                os.pread(fd, size, off)
                lat[k].append(time.perf_counter_ns() - t)

        threads = [threading.Thread(target=reader, args=(k,)) for k in range(readers)]
        t0 = time.perf_counter()
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        wall = time.perf_counter() - t0
    finally:
        os.close(fd)
    us = np.concatenate([np.array(x) for x in lat]) / 1e3
    p50, p99, p999 = np.percentile(us, [50, 99, 99.9])
    return {"readers": readers, "bytes": size, "p50_us": p50, "p99_us": p99, "p99.9_us": p999,
            "reads_per_s": us.size / wall}


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--checkpoint", default="checkpoints/v41-engram", help="created here if missing")
    args = p.parse_args()
    ckpt = ensure_checkpoint(Path(args.checkpoint), args.quick)
    # cold reads first: pages this process has mapped (the hot part's warmup) cannot be dropped
    n = 300 if args.quick else 2000
    cold = [cold_reads(ckpt, readers, size, n) for readers in (1, 4) for size in (ROW, 4096)]
    print_table(cold, ["readers", "bytes", "p50_us", "p99_us", "p99.9_us", "reads_per_s"])
    print()
    hot = hot_decode(ckpt, 200 if args.quick else 2000)
    print_table(hot, ["case", "us_per_token_48_rows", "speedup_vs_cast"])
    write_json(args.json, {"hot": hot, "cold": cold, "table_rows": ckpt.config.engram_num_embeddings})


if __name__ == "__main__":
    main()
