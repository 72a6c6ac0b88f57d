"""`engramflow profile`: trace + overlap report + Gantt chart + py-spy flame graphs of a run."""
from __future__ import annotations

import json


def cmd_profile(args) -> int:
    from engramflow.errors import EngramflowError
    from engramflow.profiling.profile_run import run_profile

    if not args.duration > 0:
        raise EngramflowError(f"--duration must be > 0 seconds, got {args.duration!r}")
    summary = run_profile(args.checkpoint, args.out, duration_s=args.duration, backbone=args.backbone,
                          block_ms=args.block_ms, stages=args.stages, address=args.address,
                          pyspy_rate=args.rate)
    table = open(summary["overlap"]["text"]).read().splitlines()
    print("\n".join(table[:9] + ([f"... {len(table) - 9} more rows"] if len(table) > 9 else [])))
    print("medians:", json.dumps(summary["overlap_summary"]))
    for name, p in summary["profiles"].items():
        print(f"{name:>14} pid {p['pid']}: " + (p["error"] or f"{p['svg']} ({p['samples']} samples)"))
    print(f"trace: {summary['trace']}  gantt: {summary['gantt']}  overlap: {summary['overlap']['text']} "
          f"({summary['decode_steps']} decode steps)")
    return 0


def register(sub) -> None:
    p = sub.add_parser("profile", help="run a traced workload with py-spy on every actor; write trace, "
                                       "overlap report, Gantt chart and flame graphs")
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--duration", type=float, default=10.0, help="seconds of workload (and of sampling)")
    p.add_argument("--backbone", default="emulated", choices=["reference", "emulated", "v41"])
    p.add_argument("--block-ms", type=float, default=2.0, help="emulated backbone: time per block")
    p.add_argument("--stages", type=int, default=1)
    p.add_argument("--address", help="Ray address (e.g. auto); default: a local instance")
    p.add_argument("--rate", type=int, default=100, help="py-spy samples per second")
    p.set_defaults(func=cmd_profile)
