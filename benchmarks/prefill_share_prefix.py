"""prefill-job's --share-prefix on a dataset whose rows share an instruction: the rows' driver
(prefill_rows, as each replica runs it) on an in-process Engine over v41-small, with and without
the option; reports the tokens prefilled (exact) and the wall time (noisy on a shared machine),
and checks the records are the same bit for bit."""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from bench_serve import checkpoint  # noqa: E402
from common import parser, write_json  # noqa: E402

from engramflow.data.prefill.prompts import RowSpec, prefill_rows  # noqa: E402
from engramflow.data.prefill.schema import output_schema  # noqa: E402
from engramflow.pipeline.engine import Engine  # noqa: E402


def run(engine, rows, share: bool, max_rows: int) -> tuple[list, int, float]:
    written, submit = [], engine.submit
    engine.submit = lambda reqs: (written.extend(r.ids.size for r in reqs), submit(reqs))[1]
    try:
        t = time.perf_counter()
        spec = RowSpec("ids", True, "id", top_k=5, share_prefix=share)
        records = list(prefill_rows(engine, iter(rows), spec, output_schema(engine.cfg.engram_layer_ids), None,
                                    max_rows=max_rows))
        seconds = time.perf_counter() - t
    finally:
        del engine.submit
    picks = [(r["next_token"], r["next_logprob"], r["topk_tokens"], r["topk_logprobs"]) for r in records]
    return picks, sum(written), seconds


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--instruction", type=int, default=600, help="tokens of the shared instruction")
    p.add_argument("--own", type=int, default=60, help="tokens of each row's own text")
    p.add_argument("--max-rows", type=int, default=8, help="rows open at once (prefill_rows' default)")
    p.add_argument("--workdir", default="checkpoints")
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    rng = np.random.default_rng(0)
    instruction = rng.integers(300, 60000, args.instruction).tolist()
    rows = [(f"r{i}", instruction + rng.integers(300, 60000, args.own).tolist(), None) for i in range(args.rows)]
    engine = Engine(checkpoint(Path(args.workdir) / "v41-small", "v41-small"))
    try:
        run(engine, rows[:2], False, args.max_rows)  # warm-up
        on = run(engine, rows, True, args.max_rows)  # first: any warm-up left would count against it
        off = run(engine, rows, False, args.max_rows)
    finally:
        engine.shutdown()
    assert on[0] == off[0], "rows differ with --share-prefix"
    print(f"{args.rows} rows = {args.instruction}-token shared instruction + {args.own} own tokens, "
          f"{args.max_rows} open at once: tokens prefilled {off[1]} -> {on[1]} ({on[1] / off[1]:.2f}x), "
          f"wall {off[2]:.1f} s -> {on[2]:.1f} s ({on[2] / off[2]:.2f}x); rows bit-identical")
    write_json(args.json, {"tokens": [off[1], on[1]], "seconds": [off[2], on[2]], "rows": args.rows,
                           "instruction": args.instruction, "own": args.own, "max_rows": args.max_rows})


if __name__ == "__main__":
    main()
