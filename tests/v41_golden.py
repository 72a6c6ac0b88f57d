"""Shared helpers for the v41 tests: the committed small checkpoint and the official golden numbers.

tests/data/v41_small holds a small seeded V4.1 model in the released format and logits the
official DeepSeek V4.1 code produced for it (PROVENANCE.md). Bit equality is expected on the
kind of machine the numbers came from (same torch, an AVX-512 CPU: the same fp32 GEMM kernels);
elsewhere the comparison falls back to the official code's own decode-vs-prefill agreement.
"""
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from engramflow.kernels.projection import cpu_has_native_bf16
from engramflow.pipeline.engine import Engine

V41_SMALL = Path(__file__).parent / "data" / "v41_small"


def golden() -> dict[str, torch.Tensor]:
    return load_file(str(V41_SMALL / "golden.safetensors"))


def golden_meta() -> dict:
    return json.loads((V41_SMALL / "golden.json").read_text())


def bit_exact_expected() -> bool:
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    return torch.__version__ == golden_meta()["torch_version"] and " avx512f" in flags and cpu_has_native_bf16()


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
