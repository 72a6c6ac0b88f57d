"""The batched-read library (native_io.c: io_uring by raw syscalls): its C signatures. Built,
found and loaded by native_build.py, the one loader of every kernel library
($ENGRAMFLOW_NATIVE_IO_LIB names the file to use). With no usable library, or
ENGRAMFLOW_NO_NATIVE=1, `library()` is None and `why_not()` says why; readers then use a
thread pool of preads. This module imports only the standard library (setup.py loads it by
path).
"""
from __future__ import annotations

import ctypes
from pathlib import Path

try:
    from engramflow.kernels import native_build as nb
except ImportError:  # loaded by path by setup.py (no package there), which loaded the helper first
    import _engramflow_build_helper as nb

ABI_VERSION = 1  # EFIO_ABI_VERSION in native_io.c
SOURCE = Path(__file__).with_name("native_io.c")
MACHINE = nb.MACHINE
INSTALLED_NAME = f"_native_io-{MACHINE}.so"
INSTALLED = Path(__file__).with_name(INSTALLED_NAME)

_P, _I64, _INT, _UINT, _STR = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_uint, ctypes.c_char_p
SIGNATURES = {
    "efio_ring_open": (_P, [_UINT, ctypes.POINTER(ctypes.c_int)]),
    "efio_ring_close": (None, [_P]),
    "efio_ring_entries": (_UINT, [_P]),
    "efio_ring_read": (_INT, [_P, _P, _I64, _P, _P, _P, _INT, _INT, _P, _P]),
    "efio_pread_batch": (_INT, [_P, _I64, _P, _P, _P, _P, _P]),
}


def source_hash(source: Path = SOURCE) -> str:
    return nb.source_hash(source)


def _spec() -> nb.NativeLib:
    return nb.NativeLib("native_io", SOURCE, INSTALLED, "ENGRAMFLOW_NATIVE_IO_LIB", "efio", ABI_VERSION, SIGNATURES,
                        libs=())


def build_library(target: Path, cc: list[str] | None = None, source: Path = SOURCE) -> tuple[bool, str]:
    """Compile `source` into `target` (written atomically). (ok, compiler output)."""
    return _spec().build(target, cc, source)


def _open(path: Path, check_source: bool) -> tuple[ctypes.CDLL | None, str]:
    return nb.open_checked(_spec(), path, check_source)


def _load() -> tuple[ctypes.CDLL | None, str]:
    lib, why, _, _ = nb.load(_spec())
    return lib, why


_LIB = nb.Library(_spec)


def library() -> ctypes.CDLL | None:
    """The loaded library, or None (see why_not()); found or built once per process."""
    return _LIB.get()


def why_not() -> str:
    """Why library() is None ('' when it is not)."""
    return _LIB.why_not()


if __name__ == "__main__":  # python -m engramflow.kernels.native_io [target]: build, as setup.py does
    nb.build_main(build_library, INSTALLED)
