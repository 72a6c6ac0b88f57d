"""`engramflow profile`: trace + overlap report + Gantt chart + py-spy flame graphs of a run."""
from __future__ import annotations


from engramflow.cli.options import pipeline_config
from engramflow.cli.pipeline import MAX_BLOCK_MS, block_ms_arg, check_ray_address
from engramflow.cli.quiet import starting_ray
from engramflow.cli.units import format_bytes
from engramflow.pipeline.speculative import SPECULATIVE_SYNTAX


def cmd_profile(args) -> int:
    from engramflow.profiling.overlap import format_medians
    from engramflow.profiling.profile_run import check_profile_options, run_profile

    # every cheap check before the output folder or the pipeline exists (run_profile repeats
    # its own; the address probe is the command line's)
    check_profile_options(args.duration, args.rate, args.out)
    config = pipeline_config(args)
    check_ray_address(args.address)
    starting_ray()
    summary = run_profile(config, args.out, duration_s=args.duration, pyspy_rate=args.rate, idle=args.idle)
    table = open(summary["overlap"]["text"]).read().splitlines()
    print(f"backbone: {summary['backbone']}")
    print("\n".join(table[:9] + ([f"... {len(table) - 9} more rows"] if len(table) > 9 else [])))
    print("\nmedians per step kind and Engram layer (ms from the step's start; overlap.json has them all):")
    print(format_medians(summary["overlap_summary"]))
    print()
    for name, p in summary["profiles"].items():
        print(f"{name:>14} pid {p['pid']}: " + (p["error"] or f"{p['svg']} ({p['samples']} samples drawn)"))
    print("Engram bytes to the stages per layer: "
          + ", ".join(f"L{k}: {format_bytes(v)}" for k, v in summary["bytes_moved"].items()))
    if "speculative" in summary:
        s = summary["speculative"]
        print(f"speculative: {s['acceptance']:.0%} of {s['drafted']} drafted tokens accepted, {s['tokens_per_step']:.2f} "
              f"tokens per step; draft {s['draft_s'] * 1e3 / max(s['draft_steps'], 1):.2f} ms, verify "
              f"{s['verify_s'] * 1e3 / max(s['steps'], 1):.2f} ms per step ({s['gated']} steps gated off)")
    print(f"wrote: {summary['trace']}  {summary['gantt']}  {summary['overlap']['text']}  "
          f"{summary['overlap']['json']} ({summary['decode_steps']} decode steps)")
    return 0


def register(sub) -> None:
    p = sub.add_parser("profile", help="run a traced workload with py-spy on every actor; write trace, "
                                       "overlap report, Gantt chart and flame graphs")
    p.add_argument("--checkpoint", required=True, help="checkpoint folder")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--duration", type=float, default=10.0, help="seconds of workload (and of sampling)")
    p.add_argument("--backbone", default=None, choices=["reference", "emulated", "v41"],
                   help="default: what the checkpoint is (v41 for a V4.1 checkpoint, else reference)")
    p.add_argument("--block-ms", type=block_ms_arg, default=2.0,
                   help=f"emulated backbone: time per block, ms in [0, {MAX_BLOCK_MS:g}]")
    p.add_argument("--stages", type=int, default=1, help="pipeline stages")
    p.add_argument("--address", help="Ray address: auto, HOST:PORT or ray://HOST:PORT; default: a local instance")
    p.add_argument("--rate", type=int, default=100, help="py-spy samples per second")
    p.add_argument("--projection", default="host", choices=["host", "stage", "auto"],
                   help="where Engram rows are projected (see generate --projection)")
    p.add_argument("--idle", action="store_true",
                   help="keep idle and waiting stacks in the flame graphs (by default each graph is the actor's work)")
    p.add_argument("--speculative", default=None, metavar=SPECULATIVE_SYNTAX,
                   help="decode with the model's DSpark draft layers (see generate); the summary gains the "
                        "speculative stats")
    p.set_defaults(func=cmd_profile)
