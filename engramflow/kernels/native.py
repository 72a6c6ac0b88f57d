"""Build-on-first-use loader for native_kernels.c (ctypes, no build step at install time).

The shared object is compiled with the system C compiler into
~/.cache/engramflow/kernels/ (or $ENGRAMFLOW_CACHE/kernels/), named by a hash of the source,
the flags and the CPU, so a changed source or a different machine gets its own build.
Without a compiler (or with ENGRAMFLOW_NO_NATIVE=1) `library()` returns None and callers use
their numpy/torch paths; results are identical, only slower.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path

SOURCE = Path(__file__).with_name("native_kernels.c")
# -ffp-contract=fast lets a*b+c become an FMA; never -ffast-math (it flushes subnormals,
# which the E4M3 bit trick relies on, and assumes no NaNs)
_FLAG_SETS = (
    ["-O3", "-march=native", "-ffp-contract=fast", "-fPIC", "-shared", "-pthread"],
    ["-O3", "-ffp-contract=fast", "-fPIC", "-shared", "-pthread"],  # compilers without -march=native
)

_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL | None] = {}

_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_SIGNATURES = {
    # addresses travel as a bytes object (c_char_p): cheaper to pass than a numpy pointer
    "ef_gather_decode_f32": (_I64, [_P, _I64, _P, _I64, _I64, ctypes.c_char_p, _I64, _I64, _P]),
    "ef_gather_decode_bf16": (_I64, [_P, _I64, _P, _I64, _I64, ctypes.c_char_p, _I64, _I64, _P]),
    "ef_gemv": (_INT, [_INT, _P, _I64, _I64, _P, _I64, _I64, _I64, _P, _I64, _I64, _I64, _I64, _P, _I64, _P, _I64]),
    "ef_gemv_threads": (_INT, [_INT, _INT, _P, _I64, _I64, _P, _I64, _I64, _I64, _P, _I64, _I64, _I64, _I64, _P, _I64,
                                _I64]),
    "ef_dequant_rows": (_INT, [_INT, _P, _I64, _I64, _P, _I64, _I64, _I64, _I64, _I64, _I64, _P]),
}
GEMV_MAX_TOKENS = 64  # MAX_TOKENS in native_kernels.c
PACK_ROWS = 8  # BITS_ROWS in native_kernels.c: rows per group of the packed FP8 layout


def cache_dir() -> Path:
    root = os.environ.get("ENGRAMFLOW_CACHE") or Path.home() / ".cache" / "engramflow"
    return Path(root) / "kernels"


def _cpu_id() -> str:
    """Model name + flags: -march=native output must not be reused on another CPU."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def _build(cc: str) -> Path | None:
    source = SOURCE.read_bytes()
    for flags in _FLAG_SETS:
        key = hashlib.sha256(source + " ".join(flags).encode() + _cpu_id().encode() + cc.encode()).hexdigest()[:16]
        target = cache_dir() / f"native_kernels-{platform.machine()}-{key}.so"
        if target.exists():
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
        # build into a temp file and rename: concurrent processes never load a half-written .so
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        try:
            proc = subprocess.run([cc, *flags, "-o", tmp, str(SOURCE)], capture_output=True, text=True, timeout=120)
            ok, last_error = proc.returncode == 0, proc.stderr.strip()
        except (OSError, subprocess.SubprocessError) as e:  # compiler missing or hung
            ok, last_error = False, str(e)
        if ok:
            os.replace(tmp, target)
            return target
        os.unlink(tmp)
    warnings.warn(f"engramflow: native kernels failed to build with {cc}; using the slower torch/numpy "
                  f"paths. Compiler said: {last_error[:500]}")
    return None


def _load() -> ctypes.CDLL | None:
    if os.environ.get("ENGRAMFLOW_NO_NATIVE") == "1" or not SOURCE.exists():
        return None
    cc = _compiler()
    if cc is None:
        return None
    try:
        path = _build(cc)
        if path is None:
            return None
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        warnings.warn(f"engramflow: native kernels unavailable ({e}); using the torch/numpy paths")
        return None
    for name, (restype, argtypes) in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    return lib


def library() -> ctypes.CDLL | None:
    """The loaded kernels, or None when they cannot be built here (or ENGRAMFLOW_NO_NATIVE=1
    was set when the process first asked). Built and loaded once per process."""
    if not _loaded:
        with _lock:
            if not _loaded:
                _loaded["lib"] = _load()
    return _loaded["lib"]
