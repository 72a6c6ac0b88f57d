"""Builds, finds and loads the block-scaled GEMM library (block_scaled.c, through ctypes).

Where it comes from, first that works: $ENGRAMFLOW_BLOCK_SCALED_LIB (exactly that file); the
installed build next to this file (setup.py compiles it, checked against the source's hash);
a runtime build, once per user and source, in the kernels cache folder under a file lock.
One single-object library: it picks its AVX-512 or portable path itself, at run time
(cpuid), and both give the same bits. ENGRAMFLOW_BLOCK_SCALED_PATH=portable|avx512 forces
one (tests, benchmarks); ENGRAMFLOW_NO_NATIVE=1 disables the library (`library()` is None and
quant_linear runs its torch reference).

This module imports only the standard library (setup.py loads it by path).
"""
from __future__ import annotations

import contextlib
import ctypes
import hashlib
import importlib.util
import json
import os
import platform
import shlex
import subprocess
import tempfile
import threading
from pathlib import Path

ABI_VERSION = 2  # EBS_ABI_VERSION in block_scaled.c
SOURCE = Path(__file__).with_name("block_scaled.c")
MACHINE = platform.machine().lower()
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
}

_lock = threading.Lock()
_loaded: dict = {}


def _native():
    """kernels/native.py (its compiler search, cache folder and file lock), by path if needed."""
    try:
        from engramflow.kernels import native
        return native
    except ImportError:
        spec = importlib.util.spec_from_file_location("_engramflow_native", Path(__file__).with_name("native.py"))
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod


def source_hash(source: Path = SOURCE) -> str:
    return hashlib.sha256(source.read_bytes()).hexdigest()[:16]


def build_library(target: Path, cc: list[str] | None = None, source: Path = SOURCE) -> tuple[bool, str]:
    """Compile `source` into `target`, written atomically: (ok, the compiler's complaint)."""
    cc = cc or _native().compiler()
    if cc is None:
        return False, "no C compiler found (set CC, or install gcc or clang)"
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(suffix=".so.tmp", dir=target.parent)
    os.close(fd)
    cmd = [*cc, *FLAGS, f'-DEBS_SOURCE_HASH="{source_hash(source)}"', "-o", partial, str(source), "-lm"]
    try:
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
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


def _cached_build() -> tuple[Path | None, str]:
    native = _native()
    cc = native.compiler()
    if cc is None:
        return None, "no C compiler found (set CC, or install gcc or clang)"
    key = hashlib.sha256(SOURCE.read_bytes() + json.dumps([ABI_VERSION, MACHINE, cc, FLAGS]).encode()).hexdigest()
    target = native.cache_dir() / f"block_scaled-{MACHINE}-{key[:16]}.so"
    failed = target.with_suffix(".failed")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with native._file_lock(target.with_suffix(".lock")):
            fresh = os.environ.get("ENGRAMFLOW_REBUILD") == "1"
            if target.exists() and not fresh:
                return target, ""
            if failed.exists() and not fresh:
                return None, f"the build failed before (see {failed}; ENGRAMFLOW_REBUILD=1 retries)"
            ok, log = build_library(target, cc)
            if not ok:
                failed.write_text(log + "\n")
                return None, f"the build with {shlex.join(cc)} failed (full output in {failed})"
            with contextlib.suppress(FileNotFoundError):
                failed.unlink()
            return target, ""
    except OSError as e:
        return None, f"cannot build into {target.parent}: {e}"


def _open(path: Path, check_source: bool) -> tuple[ctypes.CDLL | None, str]:
    try:
        lib = ctypes.CDLL(str(path))
        for name, (restype, argtypes) in SIGNATURES.items():
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = restype, argtypes
    except (OSError, AttributeError) as e:
        return None, f"{path} is not usable ({e})"
    if lib.ebs_abi_version() != ABI_VERSION:
        return None, f"{path} has ABI version {lib.ebs_abi_version()}, this engramflow needs {ABI_VERSION}"
    if check_source and SOURCE.exists() and lib.ebs_source_hash().decode() != source_hash():
        return None, f"{path} was built from another version of {SOURCE.name} (rebuild or reinstall)"
    return lib, ""


def _load() -> tuple[ctypes.CDLL | None, str]:
    if os.environ.get("ENGRAMFLOW_NO_NATIVE") == "1":
        return None, "disabled by ENGRAMFLOW_NO_NATIVE=1"
    explicit = os.environ.get("ENGRAMFLOW_BLOCK_SCALED_LIB")
    if explicit:
        return _open(Path(explicit), False)
    why = []
    if os.environ.get("ENGRAMFLOW_REBUILD") != "1" and INSTALLED.exists():
        lib, reason = _open(INSTALLED, True)
        if lib is not None:
            return lib, ""
        why.append(f"installed: {reason}")
    path, reason = _cached_build() if SOURCE.exists() else (None, f"{SOURCE.name} is missing")
    if path is not None:
        lib, reason = _open(path, False)
        if lib is not None:
            return lib, ""
    why.append(f"runtime build: {reason}")
    return None, "; ".join(why)


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
