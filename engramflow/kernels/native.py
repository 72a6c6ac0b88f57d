"""The native CPU kernels (native_kernels.c, through ctypes): their C signatures and which CPU
variant runs.

Built, found and loaded by native_build.py, the one loader of every kernel library
($ENGRAMFLOW_NATIVE_LIB names the file to use). One library holds several variants of the
kernels (generic; avx2, avx512 on x86-64) and picks the best the CPU supports when it loads;
ENGRAMFLOW_KERNEL_VARIANT=<name> forces one. With no usable library (or with
ENGRAMFLOW_NO_NATIVE=1) `library()` returns None, callers use their numpy/torch paths (the same
results, slower), and one RuntimeWarning per process says so and why.

This module imports only the standard library: setup.py loads it by path to build at install.
"""
from __future__ import annotations

import ctypes
import warnings
from pathlib import Path

try:
    from engramflow.kernels import native_build as nb
except ImportError:  # loaded by path by setup.py (no package there), which loaded the helper first
    import _engramflow_build_helper as nb

ABI_VERSION = 3  # EF_ABI_VERSION in native_kernels.c; bump both when an exported signature changes
GEMV_MAX_TOKENS = 64  # MAX_TOKENS in native_kernels.c
PACK_ROWS = 8  # BITS_ROWS in native_kernels.c: rows per group of the packed FP8 layout

SOURCE = Path(__file__).with_name("native_kernels.c")
MACHINE = nb.MACHINE
X86 = nb.X86
INSTALLED_NAME = f"_native_kernels-{MACHINE}.so"
INSTALLED = Path(__file__).with_name(INSTALLED_NAME)

COMMON_FLAGS = nb.COMMON_FLAGS
# Each variant is one compile of the source; the dispatcher in the library picks the best one
# the CPU runs (the cpuid tests of kernel_common.h; expected_variant below reads the same
# features from /proc/cpuinfo). avx512 adds no new code, only registers and encodings for the
# same 256-bit kernels, so its results equal avx2's bit for bit.
VARIANT_CPU = {"avx512": nb.AVX512, "avx2": nb.AVX2, "generic": nb.GENERIC}
VARIANT_FLAGS = {v: f for v, (f, _) in VARIANT_CPU.items()}
VARIANTS = tuple(VARIANT_CPU) if X86 else ("generic",)  # best first

_P, _I64, _INT, _STR = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_char_p
# Every exported kernel, (restype, argtypes), the one place the C ABI is mirrored (the loader adds
# ef_abi_version, ef_source_hash, ef_variant(s), ef_set_variant); bump ABI_VERSION (and
# EF_ABI_VERSION) with any change here.
SIGNATURES = {
    # addresses travel as a bytes object (c_char_p): cheaper to pass than a numpy pointer
    "ef_gather_decode_f32": (_I64, [_P, _I64, _P, _I64, _I64, _STR, _I64, _I64, _P]),
    "ef_gather_decode_bf16": (_I64, [_P, _I64, _P, _I64, _I64, _STR, _I64, _I64, _P]),
    "ef_gemv": (_INT, [_INT, _P, _I64, _I64, _P, _I64, _I64, _I64, _P, _I64, _I64, _I64, _I64, _P, _I64, _P, _I64]),
    "ef_gemv_threads": (_INT, [_INT, _INT, _P, _I64, _I64, _P, _I64, _I64, _I64, _P, _I64, _I64, _I64, _I64, _P,
                               _I64, _I64]),
    "ef_dequant_rows": (_INT, [_INT, _P, _I64, _I64, _P, _I64, _I64, _I64, _I64, _I64, _I64, _P]),
    "ef_to_bf16": (None, [_P, _I64, _P]),
}

_warned = False

cache_dir = nb.cache_dir
compiler = nb.compiler
cpu_flags = nb.cpu_flags
cpu_model = nb.cpu_model


def source_hash(source: Path = SOURCE) -> str:
    return nb.source_hash(source)


def _spec() -> nb.NativeLib:
    return nb.NativeLib("native_kernels", SOURCE, INSTALLED, "ENGRAMFLOW_NATIVE_LIB", "ef", ABI_VERSION, SIGNATURES,
                        {v: VARIANT_CPU[v] for v in VARIANTS}, variant_env="ENGRAMFLOW_KERNEL_VARIANT")


def build_library(target: Path, cc: list[str] | None = None, source: Path = SOURCE) -> tuple[bool, str]:
    """Compile `source` into the shared library `target` (written atomically): every variant
    this compiler can build (the generic one is required), plus the dispatcher. Returns
    (ok, log: the failing commands and the compiler's messages)."""
    return _spec().build(target, cc, source)


def runtime_paths(cc: list[str]) -> tuple[Path, Path]:
    """(library, failure marker) of the runtime build with this compiler."""
    return _spec().runtime_paths(cc)


def _open(path: Path, check_source: bool) -> tuple[ctypes.CDLL | None, str]:
    """Load and check one library: (lib, '') or (None, why it is refused)."""
    return nb.open_checked(_spec(), path, check_source)


def _warn_fallback(reason: str) -> None:
    global _warned
    if _warned:
        return
    _warned = True
    warnings.warn(f"engramflow: native C kernels unavailable ({reason}); MXFP8 row gathers and the Engram "
                  f"projection GEMV run on the numpy/torch fallback, several times slower (~9x for gathers). "
                  f"Install a C compiler and reinstall (pip install -e .), or set ENGRAMFLOW_REBUILD=1 to retry "
                  f"the build.", RuntimeWarning, stacklevel=4)


_LIB = nb.Library(_spec, on_missing=_warn_fallback)


def library() -> ctypes.CDLL | None:
    """The loaded kernels, or None when no usable library exists or can be built here (or
    ENGRAMFLOW_NO_NATIVE=1 was set when the process first asked). Found (or built) and loaded
    once per process; the first None warns once, except when ENGRAMFLOW_NO_NATIVE=1 asked for it."""
    first = not _LIB._done
    lib = _LIB.get()
    if first and _LIB.state.get("note"):
        warnings.warn(f"engramflow: {_LIB.state['note']}", RuntimeWarning, stacklevel=2)
    return lib


def variant() -> str | None:
    """The kernel variant in use ('avx512', 'avx2', 'generic'), None without the library."""
    library()
    return _LIB.variant()


def set_variant(name: str) -> None:
    """Force a variant in this process ('auto': the best this CPU runs); tests, benchmarks."""
    rc = _LIB.set_variant(name)
    if rc:
        raise ValueError(f"kernel variant {name!r} is not available here (code {rc})")


def expected_variant(flags: set[str] | None = None) -> str:
    """The variant the dispatcher should pick for these /proc/cpuinfo flags (default: this CPU)."""
    return _spec().expected_variant(flags)


def info() -> dict:
    """How the kernels were found and which variant runs (loads them if not yet loaded)."""
    library()
    flags = cpu_flags()
    shown = sorted(f for f in flags if f in {"avx", "avx2", "fma", "f16c", "avx512f", "avx512dq", "avx512bw",
                                             "avx512vl", "avx512_bf16", "amx_bf16", "amx_tile", "asimd", "sve"})
    out = _LIB.info()
    out["variant_expected"] = expected_variant(flags)
    out.update(cache_dir=str(cache_dir()), cpu={"machine": MACHINE, "model": cpu_model(), "flags": shown})
    return out


if __name__ == "__main__":  # python -m engramflow.kernels.native [target]: build, as setup.py does
    nb.build_main(build_library, INSTALLED)
