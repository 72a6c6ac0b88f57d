"""The one loader of engramflow's C libraries: building, caching, checking and loading them
through ctypes, and reporting which CPU variant runs.

Every library (native_kernels.c: gathers and the projection GEMV; block_scaled.c: the exact
block-scaled GEMM and the row-invariant dense linear; native_io.c: batched reads) is described
by a `NativeLib` (sources, installed file, ABI function, exported signatures, variants) in its
module (native.py, block_scaled_lib.py, native_io.py), and built and loaded here, the same way.

Building (kernel_common.h states the C side of the discipline): every library is compiled with
the same flags, COMMON_FLAGS (-O3 -ffp-contract=off: the compiler fuses no multiply-add on its
own; the kernels write out each FMA their bits need). A library with variants is one compile per
variant (its -m flags, -DEK_VARIANT=<name>) plus the dispatcher (-DEK_DISPATCH,
-DEK_HAVE_<V> for each variant that built), linked into one file; the dispatcher picks the best
variant the CPU supports when the library loads. The generic variant must build; a SIMD variant
this compiler cannot build is left out (the log says so). A library without variants is one
compile.

Where a library comes from, first that works:
1. the env var the library names (e.g. $ENGRAMFLOW_NATIVE_LIB): exactly that file;
2. the installed build: `pip install` (setup.py) compiles it next to its source;
3. a runtime build, once per user and source: into cache_dir() (~/.cache/engramflow/kernels,
   or $ENGRAMFLOW_CACHE/kernels), keyed by a hash of the sources (the .c and the headers it
   includes), ABI version, compiler and flags, under a file lock so concurrent processes (Ray
   actors) build it once. A failed build leaves a `.failed` marker holding the compiler's
   output, and later processes fall back without running the compiler again;
   ENGRAMFLOW_REBUILD=1 (or deleting the marker) retries, and also skips the installed build
   and recompiles the cached one.
A library is used only if its ABI version matches (else it is stale) and, for the installed
build, if it was compiled from the sources next to it (the freshness check: the source hash
built into the library). ENGRAMFLOW_NO_NATIVE=1 loads nothing. A library's `variant_env`
(e.g. ENGRAMFLOW_KERNEL_VARIANT) forces one of its variants.

This module imports only the standard library: setup.py loads it and the three library modules
by path to build at install.
"""
from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import hashlib
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

MACHINE = platform.machine().lower()
X86 = MACHINE in ("x86_64", "amd64")
NO_COMPILER = "no C compiler found (set CC, or install gcc or clang)"
HERE = Path(__file__).resolve().parent
COMMON_HEADER = HERE / "kernel_common.h"
# One policy for every library (kernel_common.h says why): never -ffast-math (it flushes
# subnormals, which the E4M3 bit tricks rely on, and assumes no NaNs), no implicit FMA.
COMMON_FLAGS = ("-O3", "-ffp-contract=off", "-fPIC", "-pthread")
# the x86-64 variants, best first, as (compile flags, /proc/cpuinfo flags the CPU needs); the
# dispatcher's cpuid tests (kernel_common.h) check the same features
AVX2 = (("-mavx2", "-mfma", "-mf16c"), ("avx2", "fma", "f16c"))
AVX512 = (("-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512dq", "-mavx512bw", "-mavx512vl"),
          ("avx2", "fma", "f16c", "avx512f", "avx512dq", "avx512bw", "avx512vl"))
AVX512BF16 = ((*AVX512[0], "-mavx512bf16"), (*AVX512[1], "avx512_bf16"))
GENERIC = ((), ())


def cache_dir() -> Path:
    root = os.environ.get("ENGRAMFLOW_CACHE") or Path.home() / ".cache" / "engramflow"
    return Path(root) / "kernels"


def source_hash(*sources: Path) -> str:
    """The hash built into a library: of its .c and every header it includes (kernel_common.h)."""
    h = hashlib.sha256()
    for source in (*sources, COMMON_HEADER) if len(sources) == 1 else sources:
        h.update(Path(source).read_bytes())
    return h.hexdigest()[:16]


def compiler() -> list[str] | None:
    """$CC (may carry arguments, e.g. 'ccache gcc') or the first of cc, gcc, clang on PATH; None
    when there is none."""
    cc = os.environ.get("CC")
    if cc:
        argv = shlex.split(cc)
        return argv if argv and shutil.which(argv[0]) else None
    for name in ("cc", "gcc", "clang"):
        if shutil.which(name):
            return [name]
    return None


@contextlib.contextmanager
def file_lock(path: Path):
    try:
        import fcntl
    except ImportError:  # not POSIX: the atomic rename still keeps loaders safe
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


# ---- CPU features ------------------------------------------------------------------------------

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


# ---- a library -----------------------------------------------------------------------------------

@dataclasses.dataclass
class NativeLib:
    stem: str  # file names: <stem>-<machine>[-<key>].so
    source: Path
    installed: Path
    env_var: str  # names exactly the library file to use
    prefix: str  # of the exported names: <prefix>_abi_version, <prefix>_source_hash, <prefix>_variant...
    abi_version: int
    signatures: dict  # name -> (restype, argtypes), the library's own functions
    # name -> (compile flags, /proc/cpuinfo flags), best first, "generic" last; empty: one
    # object, no dispatcher (native_io.c)
    variants: dict = dataclasses.field(default_factory=dict)
    variant_env: str | None = None  # forces a variant in this process
    variant_aliases: dict = dataclasses.field(default_factory=dict)  # other names of variants
    libs: tuple = ("-lm",)

    @property
    def abi_function(self) -> str:
        return f"{self.prefix}_abi_version"

    @property
    def hash_function(self) -> str:
        return f"{self.prefix}_source_hash"

    @property
    def build_flags(self) -> tuple:
        return (COMMON_FLAGS, {v: f for v, (f, _) in self.variants.items()})

    def all_signatures(self) -> dict:
        _str, _int = ctypes.c_char_p, ctypes.c_int
        sig = {self.abi_function: (_int, []), self.hash_function: (_str, [])}
        if self.variants:
            sig.update({f"{self.prefix}_variant": (_str, []), f"{self.prefix}_variants": (_str, []),
                        f"{self.prefix}_set_variant": (_int, [_str])})
        return {**sig, **self.signatures}

    def source_hash(self) -> str:
        return source_hash(self.source)

    def runtime_paths(self, cc: list[str]) -> tuple[Path, Path]:
        """(library, failure marker) of the runtime build with this compiler."""
        h = hashlib.sha256(self.source_hash().encode())
        h.update(json.dumps([self.abi_version, MACHINE, cc, *self.build_flags]).encode())
        target = cache_dir() / f"{self.stem}-{MACHINE}-{h.hexdigest()[:16]}.so"
        return target, target.with_suffix(".failed")

    def buildable_variants(self) -> tuple[str, ...]:
        return tuple(v for v in self.variants if X86 or v == "generic")

    def expected_variant(self, flags: set[str] | None = None) -> str | None:
        """The variant the dispatcher should pick for these /proc/cpuinfo flags (default: this CPU)."""
        if not self.variants:
            return None
        flags = cpu_flags() if flags is None else flags
        return next(v for v in self.buildable_variants() if all(f in flags for f in self.variants[v][1]))

    def build(self, target: Path, cc: list[str] | None = None, source: Path | None = None) -> tuple[bool, str]:
        """Compile the library into `target` (written atomically: no process ever loads a half-written
        file): every variant this compiler can build (the generic one is required) and the
        dispatcher, or the one object. Returns (ok, log: the failing commands and the compiler's
        messages; with ok, the variants it could not build)."""
        cc = cc or compiler()
        if cc is None:
            return False, NO_COMPILER
        source = Path(source or self.source)
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
            objects: list[str] = []
            if self.variants:
                cmds = {v: [*cc, *COMMON_FLAGS, *self.variants[v][0], f"-DEK_VARIANT={v}", "-c", "-o",
                            str(tmp / f"{v}.o"), str(source)] for v in self.buildable_variants()}
                with ThreadPoolExecutor(len(cmds)) as pool:
                    built = dict(zip(cmds, pool.map(run, cmds.values())))
                if not built["generic"]:
                    return False, "\n".join(log)
                have = [v for v in cmds if built[v]]
                dispatch = [*cc, *COMMON_FLAGS, "-DEK_DISPATCH", f'-DEK_SOURCE_HASH="{digest}"',
                            *[f"-DEK_HAVE_{v.upper()}=1" for v in have if v != "generic"], "-c", "-o",
                            str(tmp / "dispatch.o"), str(source)]
                if not run(dispatch):
                    return False, "\n".join(log)
                objects = [*[str(tmp / f"{v}.o") for v in have], str(tmp / "dispatch.o")]
            else:
                one = [*cc, *COMMON_FLAGS, f'-DEK_SOURCE_HASH="{digest}"', "-c", "-o", str(tmp / "lib.o"),
                       str(source)]
                if not run(one):
                    return False, "\n".join(log)
                objects = [str(tmp / "lib.o")]
            fd, partial = tempfile.mkstemp(suffix=".so.tmp", dir=target.parent)
            os.close(fd)
            try:
                if not run([*cc, "-shared", "-pthread", "-o", partial, *objects, *self.libs]):
                    return False, "\n".join(log)
                os.chmod(partial, 0o755)  # mkstemp made it 0600: other users of a shared install load it too
                os.replace(partial, target)
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(partial)
        return True, "\n".join(log)


def runtime_build(spec: NativeLib) -> tuple[Path | None, str]:
    """The cached runtime build, compiled here if needed: (path, '') or (None, why not)."""
    cc = compiler()
    if cc is None:
        return None, NO_COMPILER
    target, marker = spec.runtime_paths(cc)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with file_lock(target.with_suffix(".lock")):
            if os.environ.get("ENGRAMFLOW_REBUILD") != "1":
                if target.exists():
                    return target, ""
                if marker.exists():
                    return None, (f"the build failed before (see {marker}; ENGRAMFLOW_REBUILD=1 or deleting it "
                                  f"retries)")
            ok, log = spec.build(target, cc)
            if ok:
                with contextlib.suppress(FileNotFoundError):
                    marker.unlink()
                return target, ""
            marker.write_text(f"{shlex.join(cc)} failed to build {spec.source}:\n{log}\n")
            first = next((line for line in log.splitlines() if line and not line.startswith("$")), "")
            return None, f"the build with {shlex.join(cc)} failed ({first[:200]}; full output in {marker})"
    except OSError as e:  # unwritable cache directory
        return None, f"cannot build into {target.parent}: {e}"


def open_checked(spec: NativeLib, path: Path, check_source: bool) -> tuple[ctypes.CDLL | None, str]:
    """Load and check one library: (lib, '') or (None, why it is refused)."""
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        return None, f"{path} does not load ({e})"
    try:
        abi = getattr(lib, spec.abi_function)
    except AttributeError:
        return None, f"{path} exports no {spec.abi_function} (a build older than ABI {spec.abi_version})"
    abi.restype, abi.argtypes = ctypes.c_int, []
    if abi() != spec.abi_version:
        return None, f"{path} has ABI version {abi()}, this engramflow needs {spec.abi_version} (a stale build)"
    try:
        for name, (restype, argtypes) in spec.all_signatures().items():
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = restype, argtypes
    except AttributeError as e:
        return None, f"{path} lacks a function ({e})"
    built_from = (getattr(lib, spec.hash_function)() or b"").decode()
    if check_source and spec.source.exists() and built_from != spec.source_hash():
        return None, f"{path} was built from another version of {spec.source.name} or its headers (rebuild or reinstall)"
    return lib, ""


def load(spec: NativeLib) -> tuple[ctypes.CDLL | None, str, str | None, list[str]]:
    """(library, why not, where it came from: explicit | installed | runtime-build, what was
    tried and refused)."""
    if os.environ.get("ENGRAMFLOW_NO_NATIVE") == "1":
        return None, "disabled by ENGRAMFLOW_NO_NATIVE=1", None, []
    explicit = os.environ.get(spec.env_var)
    if explicit:
        candidates = [("explicit", lambda: (Path(explicit), ""), False)]
    else:
        candidates = []
        if os.environ.get("ENGRAMFLOW_REBUILD") != "1":
            installed = spec.installed
            candidates.append(("installed", lambda: (installed, "" if installed.exists() else "not built"), True))
        if spec.source.exists():
            candidates.append(("runtime-build", lambda: runtime_build(spec), False))
    tried: list[str] = []
    for kind, locate, check_source in candidates:
        path, why = locate()
        if path is not None and not why:
            lib, why = open_checked(spec, path, check_source)
            if lib is not None:
                return lib, "", kind, tried
        tried.append(f"{kind}: {why}")
    return None, "; ".join(tried) or f"{spec.source.name} is missing", None, tried


class Library:
    """One library in this process: found (or built) and loaded once, on first use. `spec` is a
    function returning the NativeLib (read at load time, so a test can point it elsewhere)."""

    def __init__(self, spec: Callable[[], NativeLib], on_missing: Callable[[str], None] | None = None):
        self._spec = spec
        self._on_missing = on_missing
        self._lock = threading.Lock()
        self._done = False
        self.lib: ctypes.CDLL | None = None
        self.state: dict = {}  # how it got its answer: path, source, tried, reason, note

    def get(self) -> ctypes.CDLL | None:
        if not self._done:
            with self._lock:
                if not self._done:
                    self._load()
                    self._done = True
        return self.lib

    def _load(self) -> None:
        spec = self._spec()
        lib, why, kind, tried = load(spec)
        self.state.update(path=str(lib._name) if lib is not None else None, source=kind, tried=tried,
                          reason=why or None, note=None)
        if lib is not None and spec.variant_env and os.environ.get(spec.variant_env):
            want = os.environ[spec.variant_env]
            rc = self._set(lib, spec, want)
            if rc:
                why_rc = "is not in this build" if rc == 1 else "needs instructions this CPU lacks"
                self.state["note"] = f"{spec.variant_env}={want} {why_rc}; using {self._variant(lib, spec)}"
        self.lib = lib
        if lib is None and self._on_missing is not None and os.environ.get("ENGRAMFLOW_NO_NATIVE") != "1":
            self._on_missing(why)

    @staticmethod
    def _set(lib, spec: NativeLib, name: str) -> int:
        name = spec.variant_aliases.get(name, name)
        return getattr(lib, f"{spec.prefix}_set_variant")(name.encode())

    @staticmethod
    def _variant(lib, spec: NativeLib) -> str | None:
        return getattr(lib, f"{spec.prefix}_variant")().decode() if spec.variants else None

    def why_not(self) -> str:
        """Why get() is None ('' when it is not)."""
        self.get()
        return self.state.get("reason") or ""

    def variant(self) -> str | None:
        """The variant running now (None without the library or for a library without variants)."""
        lib = self.get()
        return self._variant(lib, self._spec()) if lib is not None else None

    def variants_built(self) -> list[str]:
        lib, spec = self.get(), self._spec()
        if lib is None or not spec.variants:
            return []
        return getattr(lib, f"{spec.prefix}_variants")().decode().split(",")

    def set_variant(self, name: str) -> int:
        """Force a variant ('auto': the best one the CPU runs): 0 done, 1 not in this build, 2 the
        CPU lacks it, 3 no library. Only while no kernel of this library runs."""
        lib, spec = self.get(), self._spec()
        if lib is None:
            return 3
        if name == "auto":
            name = spec.expected_variant() or "generic"
            if name not in self.variants_built():
                name = self.variants_built()[-1]
        return self._set(lib, spec, name)

    def info(self) -> dict:
        lib, spec = self.get(), self._spec()
        return {
            "library": self.state.get("path"),
            "build": {"installed": "installed", "runtime-build": "cached runtime build",
                      "explicit": spec.env_var}.get(self.state.get("source"), "none"),
            "abi_version": getattr(lib, spec.abi_function)() if lib is not None else None,
            "abi_expected": spec.abi_version,
            "variant": self.variant(),
            "variants_built": self.variants_built(),
            "variant_expected": spec.expected_variant(),
            "fallback_reason": None if lib is not None else self.state.get("reason"),
            "rejected": list(self.state.get("tried", [])),
            "installed_path": str(spec.installed),
        }


def build_main(build: Callable[[Path], tuple[bool, str]], installed: Path) -> None:
    """`python -m engramflow.kernels.<module> [target]`: build, as setup.py does."""
    dest = Path(sys.argv[1]) if len(sys.argv) > 1 else installed
    ok, text = build(dest)
    if text:
        print(text, file=sys.stderr)
    print(f"{'built' if ok else 'FAILED to build'} {dest}")
    sys.exit(0 if ok else 1)
