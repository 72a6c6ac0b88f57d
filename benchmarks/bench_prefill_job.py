"""prefill-job throughput: the Ray Data job (1 and 2 Engine replicas) vs a plain loop over one
in-process Engine, on the bundled Python-docs dataset and the tiny synthetic checkpoint.

The job is timed end to end (Ray Data planning, replica start-up with its checkpoint load, reads,
the output write); the plain loop only its prefills, with its Engine built beforehand (that
load time is printed separately). So `ratio` (job tokens/s / loop tokens/s) includes the job's
fixed costs, which shrink relative to the work as the dataset grows. `prefill_s` is the sum of
the rows' `prefill_ms` (time inside the model), so `seconds - prefill_s / replicas` is roughly
the job's fixed and per-batch overhead.

Pipeline mode (`--pipeline`: one Ray pipeline fed by the driver) is timed the same way, end to
end; its `model_s` is the job's own clock, from the first prompt submitted to the last row
written (pipeline start-up and the input read excluded; the first steps' warm-up included).
Last, the micro-batch check: pipeline mode on the emulated backbone (blocks sleep like a
GPU's, 5 ms per block) with 4 stages, prompts one at a time (in_flight=1) vs 4 in flight, same rows.
"""
from __future__ import annotations

import tempfile
import time
from pathlib import Path

from common import median, parser, print_table, timed, write_json
from engramflow.data.datasets import make_table, write_table
from engramflow.data.prefill.job import prefill_job
from engramflow.model.synth import make_checkpoint
from engramflow.pipeline.engine import Engine


def plain_loop(engine: Engine, prompts: list[list[int]]) -> None:
    """The baseline: what one would write without the job (same prefill and log_softmax work)."""
    import torch

    for ids in prompts:
        s = engine.open()
        logits = engine.prefill(s, ids)
        engine.close(s)
        torch.topk(torch.log_softmax(logits, dim=-1), 5)


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--rows", type=int, help="dataset rows (default 40 with --quick, else 200)")
    p.add_argument("--replicas", default="1,2", help="replica counts to run (default 1,2)")
    args = p.parse_args()
    rows = args.rows or (40 if args.quick else 200)
    repeat = 1 if args.quick else 2
    replicas = [int(r) for r in args.replicas.split(",")]
    with tempfile.TemporaryDirectory(prefix="bench_prefill_job_") as tmp:
        run(args, Path(tmp), rows, repeat, replicas)


def run(args, tmp: Path, rows: int, repeat: int, replicas: list[int]) -> None:
    import pyarrow.parquet as pq
    import ray
    from ray.data import DataContext

    ckpt = make_checkpoint("tiny", tmp / "tiny", seed=0, progress=False)
    data = write_table(make_table(rows=rows, with_ids=True), tmp / "docs.parquet")
    prompts = make_table(rows=rows, with_ids=True).column("ids").to_pylist()
    tokens = sum(len(ids) for ids in prompts)

    t0 = time.perf_counter()
    engine = Engine(ckpt)
    load_s = time.perf_counter() - t0
    plain_loop(engine, prompts[:2])  # first-call costs out of the timing
    loop_s = median(timed(lambda: plain_loop(engine, prompts), repeat))
    del engine

    results = [{"mode": "plain Engine loop", "replicas": 1, "tokens": tokens, "seconds": loop_s,
                "prefill_s": loop_s, "tokens_per_s": tokens / loop_s, "ratio": 1.0}]
    ray.init(num_cpus=max(replicas) + 1, include_dashboard=False, log_to_driver=False)
    DataContext.get_current().enable_progress_bars = False  # keep the table readable
    for n in replicas:
        def job():
            summary = prefill_job(ckpt, data, tmp / f"out{n}.parquet", ids_column="ids", concurrency=n,
                                  batch_size=8, progress=False)
            assert summary["tokens"] == tokens and summary["rows_failed"] == 0
        job_s = median(timed(job, repeat))
        prefill_s = sum(pq.read_table(tmp / f"out{n}.parquet").column("prefill_ms").to_pylist()) / 1e3
        results.append({"mode": "prefill-job (Ray Data)", "replicas": n, "tokens": tokens, "seconds": job_s,
                        "prefill_s": prefill_s, "tokens_per_s": tokens / job_s, "ratio": loop_s / job_s})
    for stages, in_flight in ((1, 2), (2, 2)):
        out = tmp / f"pipe{stages}.parquet"
        summary = {}

        def job():
            summary.update(prefill_job(ckpt, data, out, ids_column="ids", pipeline=True, stages=stages,
                                       in_flight=in_flight, batch_size=8, progress=False))
            assert summary["tokens"] == tokens and summary["rows_failed"] == 0
        job_s = median(timed(job, repeat))
        prefill_s = sum(pq.read_table(out).column("prefill_ms").to_pylist()) / 1e3
        results.append({"mode": f"prefill-job --pipeline ({stages} stage, {in_flight} in flight)", "replicas": 1,
                        "tokens": tokens, "seconds": job_s, "model_s": summary["seconds"], "prefill_s": prefill_s,
                        "tokens_per_s": tokens / job_s, "ratio": loop_s / job_s})
    micro_rows = max(rows, 120)  # enough prompts that the pipeline's fill and drain do not dominate
    micro_data = write_table(make_table(rows=micro_rows, with_ids=True), tmp / "micro.parquet")
    micro_tokens = sum(len(ids) for ids in make_table(rows=micro_rows, with_ids=True).column("ids").to_pylist())
    micro = microbatch_check(ckpt, micro_data, tmp, micro_tokens) | {"rows": micro_rows}
    ray.shutdown()

    print(f"{rows} paragraphs of the bundled Python docs, {tokens} tokens, tiny checkpoint (reference backbone); "
          f"Engine load {load_s:.2f} s (not in the loop's time)")
    print_table(results, ["mode", "replicas", "tokens", "seconds", "model_s", "prefill_s", "tokens_per_s", "ratio"])
    print(f"\npipeline mode, emulated backbone ({micro['block_ms']} ms per block), {micro['stages']} stages, "
          f"{micro['rows']} prompts:")
    print_table([micro], ["stages", "one_in_flight_tokens_per_s", "in_flight_tokens_per_s", "in_flight", "speedup"])
    write_json(args.json, {"rows": rows, "tokens": tokens, "engine_load_s": load_s, "throughput": results,
                           "microbatch": micro})


def microbatch_check(ckpt: Path, data: Path, tmp: Path, tokens: int, stages: int = 4, block_ms: float = 5.0) -> dict:
    """Pipeline mode on the emulated backbone: one prompt in flight vs one per stage (rows equal).
    5 ms per block: a 512-token prefill chunk of a real block on a GPU; the Python-docs prompts
    are short (~58 tokens), so each prompt also costs ~20 actor calls of driver-side work here."""
    import pyarrow.parquet as pq

    rates, tables = {}, {}
    for in_flight in (1, stages):
        out = tmp / f"micro{in_flight}.parquet"
        s = prefill_job(ckpt, data, out, ids_column="ids", pipeline=True, stages=stages, in_flight=in_flight,
                        backbone="emulated", block_ms=block_ms, batch_size=8, progress=False)
        assert s["tokens"] == tokens and s["rows_failed"] == 0
        rates[in_flight] = tokens / s["seconds"]  # the job's own clock: start-up excluded
        cols = ["id", "next_token", "topk_tokens"]
        tables[in_flight] = sorted(pq.read_table(out).select(cols).to_pylist(), key=lambda r: r["id"])
    assert tables[1] == tables[stages], "prompts in flight changed the rows"
    return {"stages": stages, "block_ms": block_ms, "in_flight": stages, "one_in_flight_tokens_per_s": rates[1],
            "in_flight_tokens_per_s": rates[stages], "speedup": rates[stages] / rates[1]}


if __name__ == "__main__":
    main()
