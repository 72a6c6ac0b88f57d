"""The batched-read library (native_io.c: io_uring by raw syscalls): how to compile it and
its C signatures. Found, built and loaded as native_build.py describes, like the compute
kernels ($ENGRAMFLOW_NATIVE_IO_LIB names the file to use). With no usable library, or
ENGRAMFLOW_NO_NATIVE=1, `library()` is None and `why_not()` says why; readers then use a
thread pool of preads. This module imports only the standard library (setup.py loads it by
path).
"""
from __future__ import annotations

import ctypes
import threading
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
FLAGS = ("-O2", "-fPIC", "-shared")

_P, _I64, _INT, _UINT, _STR = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_uint, ctypes.c_char_p
SIGNATURES = {
    "efio_abi_version": (_INT, []),
    "efio_source_hash": (_STR, []),
    "efio_ring_open": (_P, [_UINT, ctypes.POINTER(ctypes.c_int)]),
    "efio_ring_close": (None, [_P]),
    "efio_ring_entries": (_UINT, [_P]),
    "efio_ring_read": (_INT, [_P, _P, _I64, _P, _P, _P, _INT, _INT, _P, _P]),
    "efio_pread_batch": (_INT, [_P, _I64, _P, _P, _P, _P, _P]),
}

_lock = threading.Lock()
_loaded: dict = {}


def source_hash(source: Path = SOURCE) -> str:
    return nb.source_hash(source)


def build_library(target: Path, cc: list[str] | None = None, source: Path = SOURCE) -> tuple[bool, str]:
    """Compile `source` into `target` (written atomically). (ok, compiler output)."""
    return nb.compile_library(target, source, FLAGS, "EFIO_SOURCE_HASH", cc, timeout=120)


def _spec() -> nb.NativeLib:
    return nb.NativeLib("native_io", SOURCE, INSTALLED, "ENGRAMFLOW_NATIVE_IO_LIB", "efio_abi_version", ABI_VERSION,
                        "efio_source_hash", SIGNATURES, build_library, (FLAGS,))


def _open(path: Path, check_source: bool) -> tuple[ctypes.CDLL | None, str]:
    return nb.open_checked(_spec(), path, check_source)


def _load() -> tuple[ctypes.CDLL | None, str]:
    lib, why, _, _ = nb.load(_spec())
    return lib, why


def library() -> ctypes.CDLL | None:
    """The loaded library, or None (see why_not()); found or built once per process."""
    if not _loaded:
        with _lock:
            if not _loaded:
                _loaded["lib"], _loaded["why"] = _load()
    return _loaded["lib"]


def why_not() -> str:
    """Why library() is None ('' when it is not)."""
    library()
    return _loaded["why"]


if __name__ == "__main__":  # python -m engramflow.kernels.native_io [target]: build, as setup.py does
    nb.build_main(build_library, INSTALLED)
