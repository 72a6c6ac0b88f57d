"""The native CPU kernels (native_kernels.c, through ctypes): how to compile them, their C
signatures, and which CPU variant runs.

Found, built and loaded as native_build.py describes ($ENGRAMFLOW_NATIVE_LIB names the file
to use). One library holds several variants of the kernels (generic; avx2, avx512 on x86-64)
and picks the best the CPU supports when it loads; ENGRAMFLOW_KERNEL_VARIANT=<name> forces
one. With no usable library (or with ENGRAMFLOW_NO_NATIVE=1) `library()` returns None, callers
use their numpy/torch paths (the same results, slower), and one RuntimeWarning per process
says so and why.

This module imports only the standard library: setup.py loads it by path to build at install.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import platform
import shlex
import subprocess
import tempfile
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

try:
    from engramflow.kernels import native_build as nb
except ImportError:  # loaded by path by setup.py (no package there), which loaded the helper first
    import _engramflow_build_helper as nb

ABI_VERSION = 2  # EF_ABI_VERSION in native_kernels.c; bump both when an exported signature changes
GEMV_MAX_TOKENS = 64  # MAX_TOKENS in native_kernels.c
PACK_ROWS = 8  # BITS_ROWS in native_kernels.c: rows per group of the packed FP8 layout

SOURCE = Path(__file__).with_name("native_kernels.c")
MACHINE = nb.MACHINE
X86 = MACHINE in ("x86_64", "amd64")
INSTALLED_NAME = f"_native_kernels-{MACHINE}.so"
INSTALLED = Path(__file__).with_name(INSTALLED_NAME)

# -ffp-contract=fast lets a*b+c become an FMA; never -ffast-math (it flushes subnormals,
# which the E4M3 bit trick relies on, and assumes no NaNs)
COMMON_FLAGS = ("-O3", "-ffp-contract=fast", "-fPIC", "-pthread")
# Each variant is one compile of the source; the dispatcher in the library picks the best one
# the CPU runs (same cpuid tests as expected_variant below). avx512 adds no new code, only
# registers and encodings for the same 256-bit kernels, so its results equal avx2's bit for bit.
VARIANT_FLAGS = {
    "avx512": ("-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512dq", "-mavx512bw", "-mavx512vl"),
    "avx2": ("-mavx2", "-mfma", "-mf16c"),
    "generic": (),
}
VARIANTS = tuple(VARIANT_FLAGS) if X86 else ("generic",)  # best first
_VARIANT_CPU_FLAGS = {  # /proc/cpuinfo flags each variant needs
    "avx512": ("avx2", "fma", "f16c", "avx512f", "avx512dq", "avx512bw", "avx512vl"),
    "avx2": ("avx2", "fma", "f16c"),
    "generic": (),
}

_P, _I64, _INT, _STR = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_char_p
# Every exported function, (restype, argtypes), the one place the C ABI is mirrored; bump
# ABI_VERSION (and EF_ABI_VERSION) with any change here.
SIGNATURES = {
    "ef_abi_version": (_INT, []),
    "ef_source_hash": (_STR, []),
    "ef_variant": (_STR, []),
    "ef_variants": (_STR, []),
    "ef_set_variant": (_INT, [_STR]),
    # addresses travel as a bytes object (c_char_p): cheaper to pass than a numpy pointer
    "ef_gather_decode_f32": (_I64, [_P, _I64, _P, _I64, _I64, _STR, _I64, _I64, _P]),
    "ef_gather_decode_bf16": (_I64, [_P, _I64, _P, _I64, _I64, _STR, _I64, _I64, _P]),
    "ef_gemv": (_INT, [_INT, _P, _I64, _I64, _P, _I64, _I64, _I64, _P, _I64, _I64, _I64, _I64, _P, _I64, _P, _I64]),
    "ef_gemv_threads": (_INT, [_INT, _INT, _P, _I64, _I64, _P, _I64, _I64, _I64, _P, _I64, _I64, _I64, _I64, _P,
                               _I64, _I64]),
    "ef_dequant_rows": (_INT, [_INT, _P, _I64, _I64, _P, _I64, _I64, _I64, _I64, _I64, _I64, _P]),
}

_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL | None] = {}
_state: dict = {}  # how library() got its answer, for info() / `engramflow doctor`
_warned = False


# ---- building ----------------------------------------------------------------------------------

cache_dir = nb.cache_dir
compiler = nb.compiler


def source_hash(source: Path = SOURCE) -> str:
    return nb.source_hash(source)


def _compile_commands(cc: list[str], source: Path, out_dir: Path) -> dict[str, list[str]]:
    return {v: [*cc, *COMMON_FLAGS, *VARIANT_FLAGS[v], f"-DEF_VARIANT={v}", "-c", "-o", str(out_dir / f"{v}.o"),
                str(source)] for v in VARIANTS}


def build_library(target: Path, cc: list[str] | None = None, source: Path = SOURCE) -> tuple[bool, str]:
    """Compile `source` into the shared library `target` (written atomically): every variant
    this compiler can build (the generic one is required), plus the dispatcher. Returns
    (ok, log: the failing commands and the compiler's messages)."""
    cc = cc or compiler()
    if cc is None:
        return False, nb.NO_COMPILER
    digest = source_hash(source)
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    log: list[str] = []

    def run(cmd: list[str]) -> bool:
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.SubprocessError) as e:  # compiler vanished or hung
            log.append(f"$ {shlex.join(cmd)}\n{e}")
            return False
        if proc.returncode != 0:
            log.append(f"$ {shlex.join(cmd)}\n{(proc.stderr or proc.stdout).strip()}")
        return proc.returncode == 0

    with tempfile.TemporaryDirectory(prefix="engramflow-build-") as tmp:
        tmp = Path(tmp)
        cmds = _compile_commands(cc, source, tmp)
        with ThreadPoolExecutor(len(cmds)) as pool:
            built = dict(zip(cmds, pool.map(run, cmds.values())))
        if not built["generic"]:
            return False, "\n".join(log)
        have = [v for v in VARIANTS if built[v]]
        dispatch = [*cc, *COMMON_FLAGS, "-DEF_DISPATCH", f'-DEF_SOURCE_HASH="{digest}"',
                    *[f"-DEF_HAVE_{v.upper()}=1" for v in have if v != "generic"], "-c", "-o",
                    str(tmp / "dispatch.o"), str(source)]
        if not run(dispatch):
            return False, "\n".join(log)
        # link in the target's directory, then rename: no process ever loads a half-written file
        fd, partial = tempfile.mkstemp(suffix=".so.tmp", dir=target.parent)
        os.close(fd)
        try:
            link = [*cc, "-shared", "-pthread", "-o", partial, *[str(tmp / f"{v}.o") for v in have],
                    str(tmp / "dispatch.o"), "-lm"]
            if not run(link):
                return False, "\n".join(log)
            os.chmod(partial, 0o755)  # mkstemp made it 0600: other users of a shared install load it too
            os.replace(partial, target)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(partial)
    return True, "\n".join(log)  # the log then lists variants this compiler could not build


def _spec() -> nb.NativeLib:
    return nb.NativeLib("native_kernels", SOURCE, INSTALLED, "ENGRAMFLOW_NATIVE_LIB", "ef_abi_version", ABI_VERSION,
                        "ef_source_hash", SIGNATURES, build_library, (COMMON_FLAGS, VARIANT_FLAGS))


def runtime_paths(cc: list[str]) -> tuple[Path, Path]:
    """(library, failure marker) of the runtime build with this compiler."""
    return _spec().runtime_paths(cc)


def _open(path: Path, check_source: bool) -> tuple[ctypes.CDLL | None, str]:
    """Load and check one library: (lib, '') or (None, why it is refused)."""
    return nb.open_checked(_spec(), path, check_source)


def _select_variant(lib: ctypes.CDLL) -> str | None:
    want = os.environ.get("ENGRAMFLOW_KERNEL_VARIANT")
    if not want:
        return None
    rc = lib.ef_set_variant(want.encode())
    if rc == 0:
        return None
    why = "is not in this build" if rc == 1 else "needs instructions this CPU lacks"
    return f"ENGRAMFLOW_KERNEL_VARIANT={want} {why}; using {lib.ef_variant().decode()}"


def _load() -> ctypes.CDLL | None:
    lib, why, kind, tried = nb.load(_spec())
    _state.update(path=None, source=kind, tried=tried, reason=why or None)
    if lib is not None:
        _state["path"] = str(lib._name)
        note = _select_variant(lib)
        if note:
            warnings.warn(f"engramflow: {note}", RuntimeWarning, stacklevel=3)
    return lib


def _warn_fallback(reason: str) -> None:
    global _warned
    if _warned:
        return
    _warned = True
    warnings.warn(f"engramflow: native C kernels unavailable ({reason}); MXFP8 row gathers and the Engram "
                  f"projection GEMV run on the numpy/torch fallback, several times slower (~9x for gathers). "
                  f"Install a C compiler and reinstall (pip install -e .), or set ENGRAMFLOW_REBUILD=1 to retry "
                  f"the build.", RuntimeWarning, stacklevel=3)


def library() -> ctypes.CDLL | None:
    """The loaded kernels, or None when no usable library exists or can be built here (or
    ENGRAMFLOW_NO_NATIVE=1 was set when the process first asked). Found (or built) and loaded
    once per process; the first None warns once, except when ENGRAMFLOW_NO_NATIVE=1 asked for it."""
    if not _loaded:
        with _lock:
            if not _loaded:
                lib = _load()
                if lib is None and os.environ.get("ENGRAMFLOW_NO_NATIVE") != "1":
                    _warn_fallback(_state["reason"])
                _loaded["lib"] = lib
    return _loaded["lib"]


def variant() -> str | None:
    """The kernel variant in use ('avx512', 'avx2', 'generic', or 'single' for a hand-built
    one-object library), None without the library."""
    lib = library()
    return lib.ef_variant().decode() if lib is not None else None


# ---- CPU features and the report for `engramflow doctor` ----------------------------------------

def cpu_flags() -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "Model", "cpu model")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or MACHINE


def expected_variant(flags: set[str] | None = None) -> str:
    """The variant the dispatcher should pick for these /proc/cpuinfo flags (default: this CPU)."""
    flags = cpu_flags() if flags is None else flags
    return next(v for v in VARIANTS if all(f in flags for f in _VARIANT_CPU_FLAGS[v]))


def info() -> dict:
    """How the kernels were found and which variant runs (loads them if not yet loaded)."""
    lib = library()
    flags = cpu_flags()
    shown = sorted(f for f in flags if f in {"avx", "avx2", "fma", "f16c", "avx512f", "avx512dq", "avx512bw",
                                             "avx512vl", "avx512_bf16", "amx_bf16", "amx_tile", "asimd", "sve"})
    out = {
        "library": _state.get("path"),
        "build": {"installed": "installed", "runtime-build": "cached runtime build",
                  "explicit": "ENGRAMFLOW_NATIVE_LIB"}.get(_state.get("source"), "none"),
        "abi_version": lib.ef_abi_version() if lib is not None else None,
        "abi_expected": ABI_VERSION,
        "variant": lib.ef_variant().decode() if lib is not None else None,
        "variants_built": lib.ef_variants().decode().split(",") if lib is not None else [],
        "variant_expected": expected_variant(flags),
        "fallback_reason": None if lib is not None else _state.get("reason"),
        "rejected": list(_state.get("tried", [])),
        "installed_path": str(INSTALLED),
        "cache_dir": str(cache_dir()),
        "cpu": {"machine": MACHINE, "model": cpu_model(), "flags": shown},
    }
    return out


if __name__ == "__main__":  # python -m engramflow.kernels.native [target]: build, as setup.py does
    nb.build_main(build_library, INSTALLED)
