"""The block-scaled GEMM library (block_scaled.c, through ctypes): its C signatures and which
variant runs. Built, found and loaded by native_build.py, the one loader of every kernel library
($ENGRAMFLOW_BLOCK_SCALED_LIB names exactly the file to use). Three variants, `avx512bf16` (the
FP8 block sums on VDPBF16PS, where a load-time probe finds it adding in order), `avx512` and
`generic` (the portable path), chosen when the library loads from what the CPU has; all give
the same bits. ENGRAMFLOW_BLOCK_SCALED_PATH=generic|avx512|avx512bf16 (or `portable`, the old
name of generic) forces one (tests, benchmarks); ENGRAMFLOW_NO_NATIVE=1 disables the library
(`library()` is None and quant_linear runs its torch reference).

This module imports only the standard library (setup.py loads it by path).
"""
from __future__ import annotations

import ctypes
from pathlib import Path

try:
    from engramflow.kernels import native_build as nb
except ImportError:  # loaded by path by setup.py (no package there), which loaded the helper first
    import _engramflow_build_helper as nb

ABI_VERSION = 5  # EBS_ABI_VERSION in block_scaled.c
SOURCE = Path(__file__).with_name("block_scaled.c")
MACHINE = nb.MACHINE
INSTALLED_NAME = f"_block_scaled-{MACHINE}.so"
INSTALLED = Path(__file__).with_name(INSTALLED_NAME)
VARIANTS = {"avx512bf16": nb.AVX512BF16, "avx512": nb.AVX512, "generic": nb.GENERIC}  # best first
ALIASES = {"portable": "generic"}

_P, _I64, _INT, _STR = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_char_p
SIGNATURES = {
    "ebs_act_quant": (None, [_P, _INT, _I64, _I64, _P, _P]),
    "ebs_linear": (_INT, [_INT, _P, _INT, _I64, _I64, _P, _P, _I64, _P, _INT, _INT, _INT]),
    "ebs_fma_gflops": (ctypes.c_double, [_INT, _I64]),
    "ebs_dense": (_INT, [_P, _INT, _I64, _I64, _P, _INT, _I64, _P, _INT]),
}


def source_hash(source: Path = SOURCE) -> str:
    return nb.source_hash(source)


def _spec() -> nb.NativeLib:
    return nb.NativeLib("block_scaled", SOURCE, INSTALLED, "ENGRAMFLOW_BLOCK_SCALED_LIB", "ebs", ABI_VERSION,
                        SIGNATURES, VARIANTS, variant_env="ENGRAMFLOW_BLOCK_SCALED_PATH", variant_aliases=ALIASES)


def build_library(target: Path, cc: list[str] | None = None, source: Path = SOURCE) -> tuple[bool, str]:
    """Compile `source` into `target`, written atomically: (ok, the compiler's complaint)."""
    return _spec().build(target, cc, source)


_LIB = nb.Library(_spec)


def library() -> ctypes.CDLL | None:
    """The loaded library, or None (see why_not()); found or built once per process. A forced
    variant the library cannot run raises ValueError."""
    lib = _LIB.get()
    if lib is not None and _LIB.state.get("note"):
        raise ValueError(_LIB.state["note"])
    return lib


def why_not() -> str:
    """Why library() is None ('' when it is not)."""
    return _LIB.why_not()


def path() -> str | None:
    """The variant the library runs now: 'avx512bf16', 'avx512' or 'generic' (None without it)."""
    library()
    return _LIB.variant()


def set_path(name: str) -> None:
    """Force 'avx512bf16', 'avx512', 'generic' (alias 'portable') or 'auto' in this process (tests, benchmarks)."""
    library()
    if _LIB.set_variant(name) != 0:
        raise ValueError(f"block-scaled GEMM variant {name!r} is not available here ({why_not() or 'unknown name'})")


def info() -> dict:
    """How the library was found and which variant runs."""
    return _LIB.info()


def fma_gflops(threads: int, seconds: float = 0.3) -> float:
    """The machine's fp32 FMA rate (GFLOP/s) on `threads` threads, on the variant the kernel runs:
    the roof of the exact block sums (each product needs its own fp32 add). Best of 3."""
    lib = library()
    if lib is None:
        raise ValueError(f"the block-scaled library is not available ({why_not()})")
    rate = lib.ebs_fma_gflops(threads, 10_000)
    iters = max(10_000, int(rate * 1e9 * seconds / (threads * 2 * 16 * 16)))
    return max(lib.ebs_fma_gflops(threads, iters) for _ in range(3))


if __name__ == "__main__":  # python -m engramflow.kernels.block_scaled_lib [target]: build, as setup.py does
    nb.build_main(build_library, INSTALLED)
