"""What the C kernel libraries share (kernels/kernel_common.h, kernels/native_build.py): the one
float32 -> bfloat16 rounding (bit for bit torch's), the persistent thread pool (results equal
to one thread's from several Python threads at once and after fork), and the one loader
(every library reports its source freshness and variant the same way)."""
from __future__ import annotations

import os
import threading

import numpy as np
import pytest
import torch

from engramflow.kernels import block_scaled_lib, native, native_build, native_io

needs_native = pytest.mark.skipif(native.library() is None, reason="native kernels unavailable here")
needs_bs = pytest.mark.skipif(block_scaled_lib.library() is None, reason="block-scaled library unavailable here")


def c_bf16(x: np.ndarray) -> np.ndarray:
    x = np.ascontiguousarray(x, np.float32)
    out = np.zeros(x.shape, np.uint16)
    native.library().ef_to_bf16(x.ctypes.data, x.size, out.ctypes.data)
    return out


def torch_bf16(x: np.ndarray) -> np.ndarray:
    return torch.from_numpy(np.ascontiguousarray(x, np.float32)).to(torch.bfloat16).view(torch.int16).numpy().view(
        np.uint16)


@needs_native
def test_bf16_rounding_equals_torch_bit_for_bit():
    special = np.array([
        0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7FFFFFFF, 0xFFFFFFFF, 0x7FA12345, 0x7FBFFFFF,  # NaNs
        0x7F800000, 0xFF800000, 0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F8000, 0x7F7F7FFF,  # inf, overflow to inf, max
        0x00000000, 0x80000000, 0x00000001, 0x80000001, 0x00007FFF, 0x00008000, 0x00018000, 0x007FFFFF,  # subnormals
        0x00800000, 0x3F808000, 0x3F818000, 0x3F808001, 0x3F80FFFF, 0xBF808000, 0xBF818000,  # ties, near ties
    ], dtype=np.uint32)
    rng = np.random.default_rng(0)
    random_bits = rng.integers(0, 2 ** 32, 100_000, dtype=np.uint64).astype(np.uint32)
    ties = (random_bits & 0xFFFF0000) | 0x8000  # every one a tie
    for bits in (special, random_bits, ties):
        x = bits.view(np.float32)
        for n in (1, 7, len(x)):  # torch's short and long (vectorized) conversions
            assert np.array_equal(c_bf16(x[:n]), torch_bf16(x[:n])), bits[:n][c_bf16(x[:n]) != torch_bf16(x[:n])]


@needs_bs
def test_block_scaled_bf16_output_is_torch_rounding_of_its_fp32_output():
    """The kernel's bf16 output (NaN rows included) is its fp32 output cast by torch."""
    from engramflow.kernels import block_scaled, quant
    gen = torch.Generator().manual_seed(0)
    codes = (torch.randn(70, 256, generator=gen) * 30).clamp(-448, 448).to(torch.float8_e4m3fn)
    tiles = torch.randint(110, 135, (3, 256 // 32), generator=gen, dtype=torch.uint8)
    w = quant.QuantWeight.fp8(codes, tiles.view(torch.float8_e8m0fnu))
    x = torch.randn(5, 256, generator=gen)
    x[1, 7] = float("nan")
    y32 = block_scaled.linear(x, w, torch.float32)
    y16 = block_scaled.linear(x, w, torch.bfloat16)
    assert torch.isnan(y32[1]).all()
    assert torch.equal(y16.view(torch.int16), y32.to(torch.bfloat16).view(torch.int16))


def gemv_case(T: int = 3, R: int = 256, C: int = 512):
    rng = np.random.default_rng(T)
    codes = rng.integers(0, 256, (R, C), dtype=np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0
    scale = (2.0 ** rng.integers(-8, 8, (R // 64, C // 128))).astype(np.float32)
    x = rng.standard_normal((T, C)).astype(np.float32)
    return codes, scale, x


def run_gemv(case, n_threads: int) -> np.ndarray:
    codes, scale, x = case
    (R, C), T = codes.shape, x.shape[0]
    out = np.zeros((T, R), np.float32)
    rc = native.library().ef_gemv_threads(n_threads, 0, codes.ctypes.data, C, 1, scale.ctypes.data, C // 128, 64, 128,
                                          x.ctypes.data, C, T, C, R, out.ctypes.data, R, 8)
    assert rc == 0
    return out


def race(fn, callers: int) -> None:
    """fn(k) on `callers` Python threads at once, k = 0..callers-1."""
    threads = [threading.Thread(target=fn, args=(k,)) for k in range(callers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


@needs_native
def test_pool_from_several_python_threads_gives_one_threads_bits():
    cases = [gemv_case(t) for t in (1, 2, 5)]
    want = [run_gemv(c, 1) for c in cases]
    bad: list[str] = []

    def hammer(k: int):
        for i in range(30):
            j = (i + k) % len(cases)
            if run_gemv(cases[j], 1 + (i + k) % 4).tobytes() != want[j].tobytes():
                bad.append(f"thread {k} call {i}")

    race(hammer, 4)
    assert not bad


@needs_native
@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork here")
def test_pool_works_in_a_forked_child():
    case = gemv_case(4)
    want = run_gemv(case, 2)  # the parent's pool exists now
    pid = os.fork()
    if pid == 0:  # the child: no workers survived the fork; its first call starts its own
        try:
            ok = run_gemv(case, 2).tobytes() == want.tobytes() and run_gemv(case, 3).tobytes() == want.tobytes()
        finally:
            os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert run_gemv(case, 2).tobytes() == want.tobytes()


@needs_bs
def test_block_scaled_pool_and_variants_give_the_same_bits():
    lib = block_scaled_lib.library()
    rng = np.random.default_rng(1)
    K, N, T = 256, 200, 9
    G = (N + 31) // 32
    w = rng.integers(0, 256, (G, K, 32), dtype=np.uint8)
    w[(w & 0x7F) == 0x7F] = 0
    ws = rng.integers(118, 132, (G, K // 32, 32), dtype=np.uint8)
    x = rng.standard_normal((T, K)).astype(np.float32)
    x_nan = x.copy()  # NaNs with payloads in their low bits (bf16 would drop them), and an infinity
    x_nan.view(np.uint32)[2, 5], x_nan.view(np.uint32)[4, 70], x_nan[6, 100] = 0x7FC00001, 0xFF812345, np.inf
    outs, nan_outs = [], []
    for variant in block_scaled_lib.info()["variants_built"]:
        block_scaled_lib.set_path(variant)
        try:
            for threads in (1, 2, 5):
                for inp, into in ((x, outs), (x_nan, nan_outs)):
                    y = np.zeros((T, N), np.float32)
                    assert lib.ebs_linear(0, inp.ctypes.data, 0, T, K, w.ctypes.data, ws.ctypes.data, N,
                                          y.ctypes.data, 0, 0, threads) == 0
                    into.append(y)
        finally:
            block_scaled_lib.set_path("auto")
    assert all(o.tobytes() == outs[0].tobytes() for o in outs)
    assert all(o.tobytes() == nan_outs[0].tobytes() for o in nan_outs)
    bad: list[str] = []

    def hammer(k: int):  # pool sizes growing and shrinking, callers racing for it
        for i in range(20):
            y = np.zeros((T, N), np.float32)
            lib.ebs_linear(0, x.ctypes.data, 0, T, K, w.ctypes.data, ws.ctypes.data, N, y.ctypes.data, 0, 0,
                           1 + (i * 3 + k) % 5)
            if y.tobytes() != outs[0].tobytes():
                bad.append(f"thread {k} call {i}")

    race(hammer, 3)
    assert not bad


def test_one_loader_reports_every_library_alike():
    for module, variants in ((native, True), (block_scaled_lib, True), (native_io, False)):
        spec = module._spec()
        assert isinstance(spec, native_build.NativeLib)
        if module.library() is None:
            continue
        info = module._LIB.info()
        assert info["abi_version"] == spec.abi_version
        if variants:
            assert "generic" in info["variants_built"] and info["variant"] in info["variants_built"]
        else:
            assert info["variant"] is None


def test_source_hash_covers_the_shared_header(tmp_path):
    """A library is stale when kernel_common.h changes, not only its .c."""
    src = native.SOURCE
    h = native_build.source_hash(src)
    assert h == native_build.source_hash(src, native_build.COMMON_HEADER)
    header = tmp_path / "kernel_common.h"
    header.write_text(native_build.COMMON_HEADER.read_text() + "\n/* changed */\n")
    assert native_build.source_hash(src, header) != h
