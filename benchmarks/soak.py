"""Bounded soak with random faults: sessions decode in lockstep while actors are killed at
random; every session's tokens are checked against the in-process Engine (mismatches must be
0). Reports steps completed, faults injected, recoveries and the longest recovery."""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import ray

from common import parser, print_table, write_json
from engramflow.model.synth import make_checkpoint
from engramflow.pipeline.engine import Engine
from engramflow.pipeline.pipeline import Pipeline
from engramflow.pipeline.recovery import RecoveryPolicy


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--checkpoint", default="checkpoints/tiny", help="made here if missing")
    p.add_argument("--minutes", type=float, default=3.0)
    p.add_argument("--sessions", type=int, default=6)
    p.add_argument("--fault-rate", type=float, default=0.05, help="chance of a kill before each step")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    minutes = min(args.minutes, 0.5) if args.quick else args.minutes
    ckpt = Path(args.checkpoint)
    if not (ckpt / "config.json").is_file():
        make_checkpoint("tiny", ckpt)
    rng = np.random.default_rng(args.seed)
    engine = Engine(ckpt)
    # a soak injects many faults on purpose: the restart budget must outlast them
    pipe = Pipeline.launch(ckpt, stages=2, policy=RecoveryPolicy(max_restarts=10_000))
    slots = list(pipe.slots)
    steps = faults = mismatches = rounds = 0
    deadline = time.monotonic() + 60 * minutes
    try:
        while time.monotonic() < deadline:
            rounds += 1
            prompts = [rng.integers(3, 120_000, rng.integers(3, 40)).tolist() for _ in range(args.sessions)]
            names = [pipe.open() for _ in prompts]
            ref = [engine.open() for _ in prompts]
            last = [int(pipe.prefill(s, ids).argmax()) for s, ids in zip(names, prompts)]
            ref_last = [int(engine.prefill(s, ids).argmax()) for s, ids in zip(ref, prompts)]
            for _ in range(12):
                if rng.random() < args.fault_rate:
                    ray.kill(pipe.actor(slots[rng.integers(len(slots))]), no_restart=True)
                    faults += 1
                out = pipe.decode_step(dict(zip(names, last)))
                ref_out = engine.decode_step(dict(zip(ref, ref_last)))
                last = [int(out[s].argmax()) for s in names]
                ref_last = [int(ref_out[s].argmax()) for s in ref]
                mismatches += sum(a != b for a, b in zip(last, ref_last))
                steps += 1
            for s in names:
                pipe.close(s)
            for s in ref:
                engine.close(s)
    finally:
        stats = pipe.recovery
        pipe.shutdown()
    row = {"minutes": minutes, "rounds": rounds, "steps": steps, "sessions": args.sessions,
           "faults_injected": faults, "recoveries": stats.faults, "restarts": stats.restarts,
           "max_recovery_s": stats.max_recovery_s, "mismatches": mismatches}
    print_table([row], list(row))
    write_json(args.json, {"rows": [row]})
    if mismatches:
        raise SystemExit(f"{mismatches} mismatching tokens")


if __name__ == "__main__":
    main()
