"""Per decode step, the quantities of the timing model (docs/architecture.md), measured from spans.

The model's clock starts when the backbone starts the step (block 0 of the first stage) and
its W is the backbone's time without Engram stalls; Ray's submit and return latency is
outside the model and is carried along as a separate `overhead_ms`. So, per step:
  f<L>        block-0 start -> projection of layer L finished (its K/V ready)
  waits       the stage's exposed wait per layer
  base_ms     backbone time with the waits taken out (block spans include the wait)
  overhead_ms driver step time minus the backbone's span
"""
from __future__ import annotations

import dataclasses
import re

from engramflow.profiling.timing_model import step_ms

_PROJECT = re.compile(r"project L(\d+)$")
_WAIT = re.compile(r"wait L(\d+)$")


@dataclasses.dataclass
class StepTiming:
    step: int
    step_ms: float  # the driver's submit -> result
    backbone_ms: float  # first block start -> last block end
    base_ms: float
    overhead_ms: float
    f_ms: dict[int, float]  # layer -> K/V ready, from block-0 start
    projection_ms: dict[int, float]
    wait_ms: dict[int, float]
    delivery_ms: dict[int, float]  # layer -> projection end -> the stage's wait ended (if it waited)

    def design_model_ms(self, n_blocks: int = 40) -> float:
        """The timing model as written (timing_model.step_ms): each table's overshoot adds."""
        f0, f1 = (self.f_ms[k] for k in sorted(self.f_ms))
        return self.overhead_ms + step_ms(self.base_ms, f0, f1, n_blocks)

    def chained_model_ms(self, entry_blocks: tuple[int, int] = (1, 14), n_blocks: int = 40) -> float:
        """The same model with the stall of the first table shifting the second table's window
        (the backbone cannot reach block 14 before it has finished waiting at block 1), and
        windows at the blocks' real entry times."""
        f0, f1 = (self.f_ms[k] for k in sorted(self.f_ms))
        return self.overhead_ms + step_ms(self.base_ms, f0, f1, n_blocks, entry_blocks, chained=True)


def step_timings(spans: list[dict]) -> list[StepTiming]:
    """Spans on one clock (StepTracer.collect) -> one StepTiming per decode step."""
    out = []
    for step in sorted((s for s in spans if s["track"] == "driver" and s["name"] == "step"
                        and s["args"].get("kind") == "decode"), key=lambda s: s["start_ns"]):
        t0, t1 = step["start_ns"], step["end_ns"]
        inside = [s for s in spans if s["track"] != "driver" and t0 <= s["start_ns"] <= t1]
        blocks = [s for s in inside if s["name"].startswith("block ")]
        if not blocks:
            continue
        b0, b_end = min(s["start_ns"] for s in blocks), max(s["end_ns"] for s in blocks)
        proj = {int(m.group(1)): s for s in inside if (m := _PROJECT.match(s["name"]))}
        waits: dict[int, list[dict]] = {}
        for s in inside:
            if m := _WAIT.match(s["name"]):
                waits.setdefault(int(m.group(1)), []).append(s)
        wait_ms = {L: sum(w["end_ns"] - w["start_ns"] for w in waits.get(L, [])) / 1e6 for L in proj}
        backbone = (b_end - b0) / 1e6
        out.append(StepTiming(
            step=step["args"].get("step", len(out)), step_ms=(t1 - t0) / 1e6, backbone_ms=backbone,
            base_ms=backbone - sum(wait_ms.values()), overhead_ms=(t1 - t0) / 1e6 - backbone,
            f_ms={L: max(0.0, (p["end_ns"] - b0) / 1e6) for L, p in proj.items()},
            projection_ms={L: (p["end_ns"] - p["start_ns"]) / 1e6 for L, p in proj.items()},
            wait_ms=wait_ms,
            delivery_ms={L: (max(w["end_ns"] for w in waits[L]) - proj[L]["end_ns"]) / 1e6
                         for L in proj if waits.get(L)}))
    return out
