"""Engram addressing speed: 50,032-token prefill and per-token decode append, both layers,
against a plain per-position Python loop (the scalar reference) in the same run."""
from __future__ import annotations

import numpy as np

from common import median, parser, print_table, tests_oracle, timed, write_json
from engramflow.io.presets import preset
from engramflow.memory.history import SessionHistory

hash_reference = tests_oracle("hash_oracle").hash_reference


def main() -> None:
    args = parser(__doc__).parse_args()
    cfg = preset("deepseek-v4.1-flash")
    history = SessionHistory.from_config(cfg)
    n_prompt = 5_000 if args.quick else 50_032
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, n_prompt)
    compressed = history.token_map.table[ids].astype(np.int64).tolist()

    def prefill():
        s = history.open()
        history.append(s, ids)
        history.close(s)

    fast = median(timed(prefill, 7))
    slow = median(timed(lambda: hash_reference(compressed, history.layout, history.pad), 1))

    s = history.open()
    history.append(s, ids[:1000])
    steps = ids[1000:3000].tolist()
    it = iter(steps)
    decode = median(timed(lambda: history.append(s, [next(it)]), len(steps)))
    window = compressed[-4:]
    decode_ref = median(timed(lambda: hash_reference(window, history.layout, history.pad), 200)) / 4

    rows = [
        {"case": f"prefill {n_prompt} tokens", "engramflow_ms": fast * 1e3, "python_loop_ms": slow * 1e3,
         "speedup": slow / fast},
        {"case": "decode append (per token)", "engramflow_ms": decode * 1e3, "python_loop_ms": decode_ref * 1e3,
         "speedup": decode_ref / decode},
    ]
    print_table(rows, ["case", "engramflow_ms", "python_loop_ms", "speedup"])
    write_json(args.json, {"rows": rows})


if __name__ == "__main__":
    main()
