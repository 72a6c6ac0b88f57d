"""Shared helpers for the v41 tests: the committed small checkpoint and the official golden numbers.

tests/data/v41_small holds a small seeded V4.1 model in the released format and logits the
official DeepSeek V4.1 code produced for it (PROVENANCE.md), once per kind of CPU it ran on:
torch's fp32 GEMM/GEMV (MKL sgemm) picks its kernel, and so its summation order, by the CPU's
instruction set, and the model's re-quantisations amplify a one-ulp change into visible logit
differences. golden_sets.json lists the sets; each carries a numerics fingerprint (a hash of a
few probe products computed with those kernels) measured where it was produced. Bit equality is
expected against the set whose fingerprint matches this machine; with none, the tests fall back
to tolerance checks (relative difference, argmax at clear margins) and warn that they did.
"""
import hashlib
import json
import warnings
from functools import lru_cache
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from engramflow.kernels.projection import cpu_has_native_bf16
from engramflow.pipeline.engine import Engine

V41_SMALL = Path(__file__).parent / "data" / "v41_small"
IDS_FILE = "golden.safetensors"  # inputs (ids, positions) are shared by every set


def numerics_fingerprint() -> str:
    """Hash of fp32 and bf16 linear products (GEMV and GEMM, the model's widths).

    Run at the current thread count on purpose: MKL's kernel depends on the instruction set
    (MKL_ENABLE_INSTRUCTIONS=AVX2 changes these bits) and, for some shapes (37 x 1024 here),
    on how many threads split the work; both change the model's logits."""
    g = torch.Generator().manual_seed(0)
    w, wk = torch.randn(512, 256, generator=g, dtype=torch.float32), torch.randn(256, 1024, generator=g, dtype=torch.float32)
    x1, x37 = (torch.randn(n, 256, generator=g, dtype=torch.float32) for n in (1, 37))
    xk1, xk37 = (torch.randn(n, 1024, generator=g, dtype=torch.float32) for n in (1, 37))
    outs = [F.linear(x.to(dt), m.to(dt)) for dt in (torch.float32, torch.bfloat16)
            for x, m in ((x1, w), (x37, w), (xk1, wk), (xk37, wk))]
    h = hashlib.sha256()
    for o in outs:
        h.update(o.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def cpu_flags() -> set[str]:
    info = Path("/proc/cpuinfo")
    text = info.read_text() if info.is_file() else ""
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.split(":", 1)[-1].split())


def golden_sets() -> list[dict]:
    return json.loads((V41_SMALL / "golden_sets.json").read_text())["sets"]


def _matches(entry: dict, fingerprint: str, flags: set[str]) -> bool:
    if entry.get("fingerprint"):
        return entry["fingerprint"] == fingerprint
    # a set produced before fingerprints existed: chosen by CPU flags until its fingerprint is measured
    rule = entry.get("flags_rule") or {}
    return set(rule.get("present", [])) <= flags and not set(rule.get("absent", [])) & flags


@lru_cache(maxsize=1)
def selected_set() -> dict | None:
    """The golden set produced on this kind of CPU (bit equality expected), or None (tolerance)."""
    if torch.__version__ != golden_meta()["torch_version"] or not cpu_has_native_bf16():
        chosen = None
    else:
        fp, flags = numerics_fingerprint(), cpu_flags()
        by_fp = [e for e in golden_sets() if e.get("fingerprint") == fp]
        chosen = (by_fp or [e for e in golden_sets() if _matches(e, fp, flags)] or [None])[0]
    if chosen is None:
        warnings.warn(f"v41 golden: no logit set for this CPU (fingerprint {numerics_fingerprint()}, torch "
                      f"{torch.__version__}); comparing with tolerances instead of bit equality", stacklevel=2)
    return chosen


def matching_set(sets: list[dict]) -> dict | None:
    """Of a golden data set list (DSpark, vision), the entry produced on this kind of CPU: by
    numerics fingerprint ("fingerprint" or "fingerprints"), else by an entry's CPU flags rule;
    None when none matches (tolerance checks then)."""
    if torch.__version__ != golden_meta()["torch_version"] or not cpu_has_native_bf16():
        return None
    fp, flags = numerics_fingerprint(), cpu_flags()
    by_fp = next((e for e in sets if fp in e.get("fingerprints", [e.get("fingerprint")])), None)
    return by_fp or next((e for e in sets if "flags_rule" in e and _matches({"flags_rule": e["flags_rule"]}, fp, flags)),
                         None)


def dspark_golden() -> tuple[dict[str, torch.Tensor], bool]:
    """The DSpark golden numbers for this CPU kind (or the first set's) and whether bit
    equality is expected."""
    sets = json.loads((V41_SMALL / "dspark_golden.json").read_text())["sets"]
    chosen = matching_set(sets)
    return load_file(str(V41_SMALL / (chosen or sets[0])["file"])), chosen is not None


def golden() -> dict[str, torch.Tensor]:
    """Inputs plus the logits of the set for this CPU (the first set when none matches)."""
    data = load_file(str(V41_SMALL / IDS_FILE))
    entry = selected_set() or golden_sets()[0]
    if entry["logits"] != IDS_FILE:
        data.update(load_file(str(V41_SMALL / entry["logits"])))
    return data


def golden_meta() -> dict:
    return json.loads((V41_SMALL / "golden.json").read_text())


def bit_exact_expected() -> bool:
    return selected_set() is not None


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def clear_margin(logits: torch.Tensor, margin: float = 0.05) -> bool:
    """Top-1 leads top-2 by more than `margin` (relative to the logit range): not a near-tie."""
    top = logits.topk(2).values
    return float(top[0] - top[1]) > margin * float(logits.max() - logits.min())


def engine_fixture(**options):
    """A module-scoped fixture: an Engine on the small model with `options`, shut down after."""
    @pytest.fixture(scope="module")
    def engine():
        e = Engine(V41_SMALL, **options)
        yield e
        e.shutdown()
    return engine
