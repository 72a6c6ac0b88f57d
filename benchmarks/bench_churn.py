"""Session churn: open, prefill, decode and close many sessions on a Pipeline and watch each
stateful actor's resident memory (VmRSS). Per-session caches and staging buffers must go back
when sessions close: the last row (every session closed) should sit near the first (before any
session), not at the peak. Prints a table (one row per sample) and writes --json."""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from common import parser, print_table, write_json
from engramflow.model.synth import make_checkpoint
from engramflow.pipeline.pipeline import Pipeline

MB = 1 << 20


def sample(pipe: Pipeline, label: str, opened: int, live: int, t0: float) -> dict:
    row = {"when": label, "opened": opened, "live": live, "s": round(time.perf_counter() - t0, 1)}
    for name, m in pipe.memory().items():
        row[f"{name}_MB"] = round(m["rss_bytes"] / MB, 1)
        if "cuda_reserved" in m:
            row[f"{name}_cuda_MB"] = round(m["cuda_reserved"] / MB, 1)
    return row


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--checkpoint", default="checkpoints/tiny", help="made here if missing")
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--backbone", default="reference")
    p.add_argument("--sessions", type=int, default=64, help="sessions over the whole run")
    p.add_argument("--concurrent", type=int, default=16, help="sessions open at once")
    p.add_argument("--prompt", type=int, default=1024, help="prompt tokens per session (lengths vary +-50%%)")
    p.add_argument("--decode", type=int, default=16, help="lockstep decode steps per wave")
    p.add_argument("--every", type=int, default=16, help="sample the RSS every this many sessions opened")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if args.quick:
        args.sessions, args.concurrent, args.prompt, args.decode = 24, 8, 384, 4
        args.every = min(args.every, 8)
    ckpt = Path(args.checkpoint)
    if not (ckpt / "config.json").is_file():
        make_checkpoint("tiny", ckpt)
    rng = np.random.default_rng(args.seed)
    pipe = Pipeline.launch(ckpt, stages=args.stages, backbone=args.backbone)
    rows: list[dict] = []
    t0 = time.perf_counter()
    try:
        rows.append(sample(pipe, "start", 0, 0, t0))
        vocab, max_len = pipe.cfg.vocab_size, pipe.cfg.max_seq_len
        opened = 0
        next_sample = args.every
        while opened < args.sessions:
            wave = min(args.concurrent, args.sessions - opened)
            names = [pipe.open() for _ in range(wave)]
            opened += wave
            last = {}
            for s in names:
                n = int(np.clip(rng.integers(args.prompt // 2, args.prompt * 3 // 2 + 1), 1, max_len - args.decode))
                last[s] = int(pipe.prefill(s, rng.integers(3, vocab, n).tolist()).argmax())
            for _ in range(args.decode):
                out = pipe.decode_step(last)
                last = {s: int(out[s].argmax()) for s in names}
            sampled = opened >= next_sample or opened == args.sessions
            if sampled:
                rows.append(sample(pipe, "open", opened, len(pipe.sessions), t0))
                while next_sample <= opened:
                    next_sample += args.every
            for s in names:
                pipe.close(s)
            if sampled and opened < args.sessions:
                rows.append(sample(pipe, "closed", opened, len(pipe.sessions), t0))
        rows.append(sample(pipe, "all closed", opened, len(pipe.sessions), t0))
        stats = pipe.stage_stats()
    finally:
        pipe.shutdown()
    columns = list(dict.fromkeys(k for r in rows for k in r))
    print_table(rows, columns)
    first, end = rows[0], rows[-1]
    summary = {}
    for c in columns:
        if c.endswith("_MB"):
            summary[c] = {"start": first[c], "peak": max(r[c] for r in rows), "end": end[c],
                          "retained": round(end[c] - first[c], 1)}
    print("retained after every session closed (MB):",
          ", ".join(f"{c[:-3]} {v['retained']:+.1f} (peak {v['peak']:.0f})" for c, v in summary.items()))
    write_json(args.json, {"args": vars(args), "rows": rows, "summary": summary, "stage_stats": stats})


if __name__ == "__main__":
    main()
