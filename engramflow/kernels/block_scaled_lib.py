"""The block-scaled GEMM library (block_scaled.c, through ctypes): how to compile it and its C
signatures. Found, built and loaded as native_build.py describes, like the other two libraries
($ENGRAMFLOW_BLOCK_SCALED_LIB names exactly the file to use). One single-object library: it
picks its AVX-512 or portable path itself, at run time (cpuid), and both give the same bits.
ENGRAMFLOW_BLOCK_SCALED_PATH=portable|avx512 forces one (tests, benchmarks);
ENGRAMFLOW_NO_NATIVE=1 disables the library (`library()` is None and quant_linear runs its
torch reference).

This module imports only the standard library (setup.py loads it by path).
"""
from __future__ import annotations

import ctypes
import os
import threading
from pathlib import Path

try:
    from engramflow.kernels import native_build as nb
except ImportError:  # loaded by path by setup.py (no package there), which loaded the helper first
    import _engramflow_build_helper as nb

ABI_VERSION = 4  # EBS_ABI_VERSION in block_scaled.c
SOURCE = Path(__file__).with_name("block_scaled.c")
MACHINE = nb.MACHINE
INSTALLED_NAME = f"_block_scaled-{MACHINE}.so"
INSTALLED = Path(__file__).with_name(INSTALLED_NAME)
# -ffp-contract=off: the scale multiplies and the add after them must stay separate roundings
FLAGS = ("-O3", "-ffp-contract=off", "-fPIC", "-pthread", "-shared")

_P, _I64, _INT, _STR = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_char_p
SIGNATURES = {
    "ebs_abi_version": (_INT, []),
    "ebs_source_hash": (_STR, []),
    "ebs_path": (_STR, []),
    "ebs_set_path": (_INT, [_STR]),
    "ebs_act_quant": (None, [_P, _INT, _I64, _I64, _P, _P]),
    "ebs_linear": (_INT, [_INT, _P, _INT, _I64, _I64, _P, _P, _I64, _P, _INT, _INT, _INT]),
    "ebs_fma_gflops": (ctypes.c_double, [_INT, _I64]),
    "ebs_dense": (_INT, [_P, _INT, _I64, _I64, _P, _INT, _I64, _P, _INT]),
}

_lock = threading.Lock()
_loaded: dict = {}


def source_hash(source: Path = SOURCE) -> str:
    return nb.source_hash(source)


def build_library(target: Path, cc: list[str] | None = None, source: Path = SOURCE) -> tuple[bool, str]:
    """Compile `source` into `target`, written atomically: (ok, the compiler's complaint)."""
    return nb.compile_library(target, source, FLAGS, "EBS_SOURCE_HASH", cc, libs=("-lm",))


def _spec() -> nb.NativeLib:
    return nb.NativeLib("block_scaled", SOURCE, INSTALLED, "ENGRAMFLOW_BLOCK_SCALED_LIB", "ebs_abi_version",
                        ABI_VERSION, "ebs_source_hash", SIGNATURES, build_library, (FLAGS,))


def _load() -> tuple[ctypes.CDLL | None, str]:
    lib, why, _, _ = nb.load(_spec())
    return lib, why


def _force_path(lib: ctypes.CDLL) -> str:
    want = os.environ.get("ENGRAMFLOW_BLOCK_SCALED_PATH")
    if not want:
        return ""
    rc = lib.ebs_set_path(want.encode())
    return "" if rc == 0 else f"ENGRAMFLOW_BLOCK_SCALED_PATH={want} is {'unknown' if rc == 1 else 'not supported here'}"


def library() -> ctypes.CDLL | None:
    """The loaded library, or None (see why_not()); found or built once per process."""
    if not _loaded:
        with _lock:
            if not _loaded:
                lib, why = _load()
                if lib is not None:
                    why = _force_path(lib)
                    if why:
                        raise ValueError(why)
                _loaded["lib"], _loaded["why"] = lib, why
    return _loaded["lib"]


def why_not() -> str:
    """Why library() is None ('' when it is not)."""
    library()
    return _loaded["why"]


def path() -> str | None:
    """The arithmetic path the library runs now: 'avx512' or 'portable' (None without it)."""
    lib = library()
    return lib.ebs_path().decode() if lib is not None else None


def set_path(name: str) -> None:
    """Force 'avx512', 'portable' or 'auto' in this process (tests, benchmarks)."""
    lib = library()
    if lib is None or lib.ebs_set_path(name.encode()) != 0:
        raise ValueError(f"block-scaled GEMM path {name!r} is not available here ({why_not() or 'unknown name'})")


def fma_gflops(threads: int, seconds: float = 0.3) -> float:
    """The machine's fp32 FMA rate (GFLOP/s) on `threads` threads, on the path the kernel runs:
    the roof of the exact block sums (each product needs its own fp32 add). Best of 3."""
    lib = library()
    if lib is None:
        raise ValueError(f"the block-scaled library is not available ({why_not()})")
    rate = lib.ebs_fma_gflops(threads, 10_000)
    iters = max(10_000, int(rate * 1e9 * seconds / (threads * 2 * 16 * 16)))
    return max(lib.ebs_fma_gflops(threads, iters) for _ in range(3))
