"""The native kernels' build and loading: ABI check, CPU dispatch, cached build failures, the
one-time fallback warning, and `engramflow doctor`. Each case that changes how the library is
found runs in a subprocess (library() loads once per process)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from engramflow.kernels import native

CC = native.compiler()
needs_cc = pytest.mark.skipif(CC is None, reason="no C compiler here")
# a process that sees no installed library (as after an install without a compiler)
WITHOUT_INSTALLED = ("from engramflow.kernels import native\n"
                     "native.INSTALLED = native.INSTALLED.with_name('absent.so')\n")


def run_py(script: str, **env_overrides) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    for key in ("ENGRAMFLOW_NO_NATIVE", "ENGRAMFLOW_NATIVE_LIB", "ENGRAMFLOW_REBUILD", "ENGRAMFLOW_KERNEL_VARIANT"):
        env.pop(key, None)
    env.update({k: str(v) for k, v in env_overrides.items()})
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script)], env=env, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.skipif(native.library() is None, reason="native kernels unavailable here")
def test_library_loads_and_reports_its_abi_version():
    lib = native.library()
    assert lib.ef_abi_version() == native.ABI_VERSION
    info = native.info()
    assert info["abi_version"] == native.ABI_VERSION
    assert info["build"] in ("installed", "cached runtime build", "ENGRAMFLOW_NATIVE_LIB")
    assert "generic" in info["variants_built"]
    assert native.variant() in info["variants_built"]


@pytest.mark.skipif(native.library() is None, reason="native kernels unavailable here")
def test_dispatched_variant_matches_cpu_flags():
    if not native.cpu_flags():
        pytest.skip("no /proc/cpuinfo flags to compare with")
    expected = native.expected_variant()
    if os.environ.get("ENGRAMFLOW_KERNEL_VARIANT") or expected not in native.info()["variants_built"]:
        pytest.skip("variant forced, or this compiler could not build the CPU's best variant")
    assert native.variant() == expected


def test_expected_variant_from_flags():
    if not native.X86:
        assert native.expected_variant({"avx2", "fma", "f16c"}) == "generic"
        return
    assert native.expected_variant(set()) == "generic"
    assert native.expected_variant({"avx2", "fma"}) == "generic"  # F16C missing
    assert native.expected_variant({"avx2", "fma", "f16c", "avx512f"}) == "avx2"
    assert native.expected_variant({"avx2", "fma", "f16c", "avx512f", "avx512dq", "avx512bw", "avx512vl"}) == "avx512"


@needs_cc
def test_every_built_variant_gives_the_same_bits_where_it_should(tmp_path):
    """avx512 must equal avx2 bit for bit (same kernels, more registers); generic runs other code."""
    script = """
        import os, sys, numpy as np
        from engramflow.kernels import native
        lib = native.library()
        assert lib is not None
        rng = np.random.default_rng(0)
        R, C, br, bc = 64, 512, 64, 128
        codes = rng.integers(0, 256, (R, C), dtype=np.uint8); codes[(codes & 0x7F) == 0x7F] = 0
        scale = (2.0 ** rng.integers(-8, 8, (R // br, C // bc))).astype(np.float32)
        res = []
        for T in (1, 2, 5):
            x = rng.standard_normal((T, C)).astype(np.float32); out = np.zeros((T, R), np.float32)
            assert lib.ef_gemv_threads(1, 0, codes.ctypes.data, C, 1, scale.ctypes.data, C // bc, br, bc,
                                       x.ctypes.data, C, T, C, R, out.ctypes.data, R, 64) == 0
            res.append(out)
        np.save(sys.argv[1] if len(sys.argv) > 1 else os.environ["OUT"], np.concatenate(res, 0))
        print(lib.ef_variant().decode())
    """
    best = native.VARIANTS.index(native.expected_variant())
    runnable = [v for v in native.info()["variants_built"] if native.VARIANTS.index(v) >= best]
    outs = {}
    for v in runnable:
        out = tmp_path / f"{v}.npy"
        proc = run_py(script, ENGRAMFLOW_KERNEL_VARIANT=v, OUT=out)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.strip() == v
        outs[v] = np.load(out)
    if "avx2" in outs and "avx512" in outs:
        assert outs["avx2"].tobytes() == outs["avx512"].tobytes()
    if "avx2" in outs:  # generic decodes the same values by another route: close, not equal
        np.testing.assert_allclose(outs["generic"], outs["avx2"], rtol=1e-4, atol=1e-3)


@needs_cc
def test_library_with_another_abi_version_is_refused(tmp_path):
    src = tmp_path / "stub.c"
    src.write_text(f"int ef_abi_version(void) {{ return {native.ABI_VERSION + 1000}; }}\n")
    stub = tmp_path / "stub.so"
    subprocess.run([*CC, "-shared", "-fPIC", "-o", str(stub), str(src)], check=True, capture_output=True)
    proc = run_py("""
        import warnings
        warnings.simplefilter("always")
        from engramflow.kernels import native
        assert native.library() is None
        print(native.info()["fallback_reason"])
    """, ENGRAMFLOW_NATIVE_LIB=stub, ENGRAMFLOW_CACHE=tmp_path / "cache")
    assert proc.returncode == 0, proc.stderr
    assert f"ABI version {native.ABI_VERSION + 1000}" in proc.stdout
    assert "stale" in proc.stderr and "RuntimeWarning" in proc.stderr


def test_failed_build_is_cached_and_not_retried(tmp_path):
    """A compiler that fails: the first process runs it and leaves a marker; the second one
    does not run it at all; ENGRAMFLOW_REBUILD=1 runs it again."""
    calls = tmp_path / "calls"
    fake_cc = tmp_path / "fakecc"
    fake_cc.write_text(f"#!/bin/sh\necho run >> {calls}\necho 'fakecc: error: nothing works' >&2\nexit 1\n")
    fake_cc.chmod(0o755)
    script = WITHOUT_INSTALLED + textwrap.dedent("""
        assert native.library() is None
        print(native.info()["fallback_reason"])
    """)
    env = dict(CC=fake_cc, ENGRAMFLOW_CACHE=tmp_path / "cache")
    first = run_py(script, **env)
    assert first.returncode == 0, first.stderr
    assert "fakecc" in first.stdout and calls.exists()
    n_first = len(calls.read_text().splitlines())
    markers = list((tmp_path / "cache" / "kernels").glob("native_kernels-*.failed"))
    assert len(markers) == 1 and "nothing works" in markers[0].read_text()

    second = run_py(script, **env)
    assert second.returncode == 0, second.stderr
    assert "failed before" in second.stdout
    assert len(calls.read_text().splitlines()) == n_first  # the compiler did not run again

    third = run_py(script, ENGRAMFLOW_REBUILD=1, **env)
    assert third.returncode == 0, third.stderr
    assert len(calls.read_text().splitlines()) > n_first


def test_fallback_warns_once_per_process(tmp_path):
    proc = run_py("""
        import warnings
        warnings.simplefilter("always")
        import numpy as np, torch
        from engramflow.kernels import mxfp8, native
        codes = np.zeros((4, 64), np.uint8); scales = np.full((4, 2), 127, np.uint8)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(3):
                mxfp8.gather_decode(codes, scales, np.array([[0, 1]]), torch.float32)
            assert native.library() is None
        hits = [w for w in caught if "native C kernels unavailable" in str(w.message)]
        assert len(hits) == 1, [str(w.message) for w in caught]
        assert "\\n" not in str(hits[0].message)
        print(hits[0].message)
    """, ENGRAMFLOW_NATIVE_LIB=tmp_path / "missing.so", ENGRAMFLOW_CACHE=tmp_path / "cache")
    assert proc.returncode == 0, proc.stderr
    assert "numpy/torch fallback" in proc.stdout


def test_no_warning_when_native_is_switched_off():
    proc = run_py("""
        import warnings
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            from engramflow.kernels import native
            assert native.library() is None
        assert not [w for w in caught if "native" in str(w.message)]
    """, ENGRAMFLOW_NO_NATIVE=1)
    assert proc.returncode == 0, proc.stderr


@needs_cc
def test_runtime_build_into_a_fresh_cache_and_reuse(tmp_path):
    script = """
        from engramflow.kernels import native
        assert native.library() is not None
        info = native.info()
        print(info["build"], info["library"])
    """
    first = run_py(script, ENGRAMFLOW_REBUILD=1, ENGRAMFLOW_CACHE=tmp_path)
    assert first.returncode == 0, first.stderr
    assert first.stdout.startswith("cached runtime build")
    built = list((tmp_path / "kernels").glob("native_kernels-*.so"))
    assert len(built) == 1
    mtime = built[0].stat().st_mtime_ns
    # a process without an installed library reuses the cached build without compiling
    second = run_py(WITHOUT_INSTALLED + textwrap.dedent(script), ENGRAMFLOW_CACHE=tmp_path)
    assert second.returncode == 0, second.stderr
    assert second.stdout.startswith("cached runtime build")
    assert built[0].stat().st_mtime_ns == mtime


def test_doctor_prints_json_report():
    proc = subprocess.run([sys.executable, "-m", "engramflow.cli", "doctor"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    k = doc["native_kernels"]
    for key in ("library", "build", "abi_version", "abi_expected", "variant", "variant_expected", "cpu"):
        assert key in k
    assert k["abi_expected"] == native.ABI_VERSION
    assert k["build"] in ("installed", "cached runtime build", "ENGRAMFLOW_NATIVE_LIB", "none")
    assert {"version", "threads", "native_bf16"} <= set(doc["torch"])
    assert doc["topology"]["numa_nodes"] and "selected_cores" in doc["topology"]["numa_nodes"][0]
    assert doc["ray"]["connected"] is False


def test_doctor_is_registered():
    from engramflow.cli.app import build_parser

    args = build_parser().parse_args(["doctor"])
    assert args.func.__name__ == "cmd_doctor"


@needs_cc
def test_installed_library_from_another_source_is_refused(tmp_path):
    """An editable install whose native_kernels.c changed since: the runtime build takes over."""
    stubs = "".join(f"void {name}(void) {{}}\n" for name in native._spec().all_signatures() if name not in
                    ("ef_abi_version", "ef_source_hash"))
    src = tmp_path / "stub.c"
    src.write_text(f"int ef_abi_version(void) {{ return {native.ABI_VERSION}; }}\n"
                   f'const char *ef_source_hash(void) {{ return "0123456789abcdef"; }}\n{stubs}')
    stub = tmp_path / "stub.so"
    subprocess.run([*CC, "-shared", "-fPIC", "-o", str(stub), str(src)], check=True, capture_output=True)
    lib, why = native._open(stub, check_source=True)
    assert lib is None and "another version" in why
    lib, why = native._open(stub, check_source=False)  # the runtime build is keyed by the source instead
    assert lib is not None and not why


@needs_cc
def test_concurrent_processes_build_once(tmp_path):
    """Three processes (say, Ray actors) start with an empty cache: one compiles, the others wait
    on the lock and load its library."""
    calls = tmp_path / "calls"
    wrapper = tmp_path / "cc-wrapper"
    wrapper.write_text(f"#!/bin/sh\necho run >> {calls}\nexec {' '.join(CC)} \"$@\"\n")
    wrapper.chmod(0o755)
    script = WITHOUT_INSTALLED + "assert native.library() is not None\nprint(native.info()['build'])\n"
    env = dict(os.environ, CC=str(wrapper), ENGRAMFLOW_CACHE=str(tmp_path / "cache"))
    for key in ("ENGRAMFLOW_NO_NATIVE", "ENGRAMFLOW_NATIVE_LIB", "ENGRAMFLOW_REBUILD"):
        env.pop(key, None)
    procs = [subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(3)]
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
        assert out.strip() == "cached runtime build"
    # one build = one compile per variant + the dispatcher + the link
    assert len(calls.read_text().splitlines()) == len(native.VARIANTS) + 2
    assert len(list((tmp_path / "cache" / "kernels").glob("native_kernels-*.so"))) == 1
