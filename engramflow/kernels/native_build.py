"""Building, caching and loading a ctypes C library: what both native libraries share.

native.py (the compute kernels) and native_io.py (batched reads) each describe their library
as a `NativeLib` (source, installed file, ABI function, exported signatures, how to compile
it) and load it with `load`. Where a library comes from, first that works:
1. the env var the library names (e.g. $ENGRAMFLOW_NATIVE_LIB): exactly that file;
2. the installed build: `pip install` (setup.py) compiles it next to its source;
3. a runtime build, once per user and source: into cache_dir() (~/.cache/engramflow/kernels,
   or $ENGRAMFLOW_CACHE/kernels), keyed by a hash of the source, ABI version, compiler and
   flags, under a file lock so concurrent processes (Ray actors) build it once. A failed build
   leaves a `.failed` marker holding the compiler's output, and later processes fall back
   without running the compiler again; ENGRAMFLOW_REBUILD=1 (or deleting the marker) retries,
   and also skips the installed build and recompiles the cached one.
A library is used only if its ABI version matches (else it is stale) and, for the installed
build, if it was compiled from the source next to it. ENGRAMFLOW_NO_NATIVE=1 loads nothing.

This module imports only the standard library: setup.py loads the two libraries' modules by
path to build at install.
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
import sys
from collections.abc import Callable
from pathlib import Path

MACHINE = platform.machine().lower()
NO_COMPILER = "no C compiler found (set CC, or install gcc or clang)"


def cache_dir() -> Path:
    root = os.environ.get("ENGRAMFLOW_CACHE") or Path.home() / ".cache" / "engramflow"
    return Path(root) / "kernels"


def source_hash(source: Path) -> str:
    return hashlib.sha256(source.read_bytes()).hexdigest()[:16]


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


@dataclasses.dataclass
class NativeLib:
    stem: str  # file names: <stem>-<machine>[-<key>].so
    source: Path
    installed: Path
    env_var: str  # names exactly the library file to use
    abi_function: str  # returns the ABI version the library was built for
    abi_version: int
    hash_function: str  # returns the hash of the source it was built from
    signatures: dict  # name -> (restype, argtypes)
    build: Callable[[Path, list], tuple[bool, str]]  # (target, cc) -> (ok, compiler log)
    build_flags: tuple  # the compile flags: part of the runtime build's key

    def runtime_paths(self, cc: list[str]) -> tuple[Path, Path]:
        """(library, failure marker) of the runtime build with this compiler."""
        h = hashlib.sha256(self.source.read_bytes())
        h.update(json.dumps([self.abi_version, MACHINE, cc, *self.build_flags]).encode())
        target = cache_dir() / f"{self.stem}-{MACHINE}-{h.hexdigest()[:16]}.so"
        return target, target.with_suffix(".failed")


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
        for name, (restype, argtypes) in spec.signatures.items():
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = restype, argtypes
    except AttributeError as e:
        return None, f"{path} lacks a function ({e})"
    built_from = (getattr(lib, spec.hash_function)() or b"").decode()
    if check_source and spec.source.exists() and built_from != source_hash(spec.source):
        return None, f"{path} was built from another version of {spec.source.name} (rebuild or reinstall)"
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


def compile_library(target: Path, source: Path, flags: tuple, hash_macro: str, cc: list[str] | None = None,
                    libs: tuple = (), timeout: float = 300) -> tuple[bool, str]:
    """Compile `source` into `target`, written atomically (a reader never sees half a library),
    with the source's hash built in as `hash_macro`: (ok, the compiler's complaint)."""
    import subprocess
    import tempfile

    cc = cc or compiler()
    if cc is None:
        return False, NO_COMPILER
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(suffix=".so.tmp", dir=target.parent)
    os.close(fd)
    cmd = [*cc, *flags, f'-D{hash_macro}="{source_hash(source)}"', "-o", partial, str(source), *libs]
    try:
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
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


def build_main(build: Callable[[Path], tuple[bool, str]], installed: Path) -> None:
    """`python -m engramflow.kernels.<module> [target]`: build, as setup.py does."""
    dest = Path(sys.argv[1]) if len(sys.argv) > 1 else installed
    ok, text = build(dest)
    if text:
        print(text, file=sys.stderr)
    print(f"{'built' if ok else 'FAILED to build'} {dest}")
    sys.exit(0 if ok else 1)
