"""Builds, finds and loads the batched-read library (native_io.c: io_uring by raw syscalls).

The same pattern as the compute kernels (native.py), for a small single-object library:
1. $ENGRAMFLOW_NATIVE_IO_LIB, when set: exactly that file.
2. The installed build: setup.py compiles it next to this file as INSTALLED_NAME.
3. A runtime build, once per user and source, into native.cache_dir() under a file lock; a
   failed build leaves a `.failed` marker (ENGRAMFLOW_REBUILD=1 retries).

A library is used only if its efio_abi_version() equals ABI_VERSION and (installed build) it
was compiled from the source next to it. With no usable library, or ENGRAMFLOW_NO_NATIVE=1,
`library()` is None and `why_not()` says why; readers then use a thread pool of preads.
This module imports only the standard library (setup.py loads it by path).
"""
from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import os
import platform
import shlex
import subprocess
import tempfile
import threading
from pathlib import Path

ABI_VERSION = 1  # EFIO_ABI_VERSION in native_io.c
SOURCE = Path(__file__).with_name("native_io.c")
MACHINE = platform.machine().lower()
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
    return hashlib.sha256(source.read_bytes()).hexdigest()[:16]


def _native():
    """The compute kernels' loader, for its compiler search, cache folder and file lock (by
    path when this module itself was loaded by path, as setup.py does)."""
    try:
        from engramflow.kernels import native
        return native
    except ImportError:
        import importlib.util
        spec = importlib.util.spec_from_file_location("_engramflow_native", Path(__file__).with_name("native.py"))
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod


def build_library(target: Path, cc: list[str] | None = None, source: Path = SOURCE) -> tuple[bool, str]:
    """Compile `source` into `target` (written atomically). (ok, compiler output)."""
    cc = cc or _native().compiler()
    if cc is None:
        return False, "no C compiler found (set CC, or install gcc or clang)"
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(suffix=".so.tmp", dir=target.parent)
    os.close(fd)
    cmd = [*cc, *FLAGS, f'-DEFIO_SOURCE_HASH="{source_hash(source)}"', "-o", partial, str(source)]
    try:
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.SubprocessError) as e:
            return False, f"$ {shlex.join(cmd)}\n{e}"
        if proc.returncode != 0:
            return False, f"$ {shlex.join(cmd)}\n{(proc.stderr or proc.stdout).strip()}"
        os.chmod(partial, 0o755)
        os.replace(partial, target)
        return True, ""
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(partial)


def _runtime_build() -> tuple[Path | None, str]:
    native = _native()
    cc = native.compiler()
    if cc is None:
        return None, "no C compiler found (set CC, or install gcc or clang)"
    key = hashlib.sha256(SOURCE.read_bytes() + json.dumps([ABI_VERSION, MACHINE, cc, FLAGS]).encode()).hexdigest()[:16]
    target = native.cache_dir() / f"native_io-{MACHINE}-{key}.so"
    marker = target.with_suffix(".failed")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with native._file_lock(target.with_suffix(".lock")):
            if os.environ.get("ENGRAMFLOW_REBUILD") != "1":
                if target.exists():
                    return target, ""
                if marker.exists():
                    return None, f"the build failed before (see {marker}; ENGRAMFLOW_REBUILD=1 retries)"
            ok, log = build_library(target, cc)
            if ok:
                with contextlib.suppress(FileNotFoundError):
                    marker.unlink()
                return target, ""
            marker.write_text(log + "\n")
            return None, f"the build with {shlex.join(cc)} failed (full output in {marker})"
    except OSError as e:
        return None, f"cannot build into {target.parent}: {e}"


def _open(path: Path, check_source: bool) -> tuple[ctypes.CDLL | None, str]:
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        return None, f"{path} does not load ({e})"
    try:
        for name, (restype, argtypes) in SIGNATURES.items():
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = restype, argtypes
    except AttributeError as e:
        return None, f"{path} lacks a function ({e})"
    if lib.efio_abi_version() != ABI_VERSION:
        return None, f"{path} has ABI version {lib.efio_abi_version()}, this engramflow needs {ABI_VERSION}"
    if check_source and SOURCE.exists() and lib.efio_source_hash().decode() != source_hash():
        return None, f"{path} was built from another version of {SOURCE.name} (rebuild or reinstall)"
    return lib, ""


def _load() -> tuple[ctypes.CDLL | None, str]:
    if os.environ.get("ENGRAMFLOW_NO_NATIVE") == "1":
        return None, "disabled by ENGRAMFLOW_NO_NATIVE=1"
    explicit = os.environ.get("ENGRAMFLOW_NATIVE_IO_LIB")
    if explicit:
        candidates = [("explicit", lambda: (Path(explicit), ""), False)]
    else:
        candidates = []
        if os.environ.get("ENGRAMFLOW_REBUILD") != "1":
            candidates.append(("installed", lambda: (INSTALLED, "" if INSTALLED.exists() else "not built"), True))
        if SOURCE.exists():
            candidates.append(("runtime-build", _runtime_build, False))
    tried = []
    for kind, locate, check_source in candidates:
        path, why = locate()
        if path is not None and not why:
            lib, why = _open(path, check_source)
            if lib is not None:
                return lib, ""
        tried.append(f"{kind}: {why}")
    return None, "; ".join(tried) or f"{SOURCE.name} is missing"


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
    import sys
    dest = Path(sys.argv[1]) if len(sys.argv) > 1 else INSTALLED
    ok, text = build_library(dest)
    if text:
        print(text, file=sys.stderr)
    print(f"{'built' if ok else 'FAILED to build'} {dest}")
    sys.exit(0 if ok else 1)
