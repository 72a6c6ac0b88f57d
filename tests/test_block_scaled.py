"""The native block-scaled linear (kernels/block_scaled.c) against the torch reference: the same
bits for FP8 and FP4 weights at every T, batch-invariant rows, and the portable path equal to
the AVX-512 one."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from engramflow.errors import EngramflowError
from engramflow.kernels import block_scaled, block_scaled_lib, quant, sum_order
from engramflow.kernels.quant import QuantWeight, fp8_act_quant, quant_linear, quant_linear_reference

pytestmark = pytest.mark.skipif(block_scaled_lib.library() is None,
                                reason=f"no block-scaled library: {block_scaled_lib.why_not()}")
T_VALUES = (1, 2, 3, 12, 13, 31, 64, 65, 512)  # 12 | 13: one register tile | two


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(0)


def heavy_tailed(shape, gen, scale=1.0):
    """Gaussian times a log-normal spread: many small quantised values, so that block sums of
    32 products do round in fp32 and the summation order shows in the bits."""
    return torch.randn(shape, generator=gen) * torch.exp(2 * torch.randn(shape, generator=gen)) * scale


def fp8_weight(n, k, gen):
    codes = heavy_tailed((n, k), gen, 30).clamp(-448, 448).to(torch.float8_e4m3fn)
    tiles = torch.randint(110, 135, (-(-n // 32), k // 32), generator=gen, dtype=torch.uint8)
    return QuantWeight.fp8(codes, tiles.view(torch.float8_e8m0fnu))


def fp4_weight(n, k, gen):
    packed = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8)
    return QuantWeight.fp4(packed, torch.randint(110, 135, (n, k // 32), generator=gen, dtype=torch.uint8))


def assert_same_bits(got, want):
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(got.view(torch.int16 if got.dtype == torch.bfloat16 else torch.int32),
                       want.view(torch.int16 if want.dtype == torch.bfloat16 else torch.int32))


def test_the_inputs_make_block_sums_round(gen):
    """Without rounding inside a block every order gives the same bits, and the tests below
    could not catch a wrong one: check that these inputs round often."""
    w = fp8_weight(64, 256, gen)
    q, _ = fp8_act_quant(heavy_tailed((8, 256), gen))
    qa = q.view(8, 8, 32).transpose(0, 1)
    exact = torch.bmm(qa.double(), w.blocks.double())
    assert (torch.bmm(qa, w.blocks).double() != exact).float().mean() > 0.05


@pytest.fixture(params=sum_order.NUMERICS)
def numerics(request):
    """Both numerics: one row in MKL's GEMV order (official) or in order (batched)."""
    with sum_order.use(request.param):
        yield request.param


@pytest.mark.parametrize("make", [fp8_weight, fp4_weight], ids=["fp8", "fp4"])
@pytest.mark.parametrize("n,k", [(333, 800), (64, 96), (1000, 2048)])
def test_native_equals_the_reference_at_every_t(gen, make, n, k, numerics):
    w = make(n, k, gen)
    x = heavy_tailed((max(T_VALUES), k), gen).bfloat16()
    assert block_scaled.linear(x[:1], w) is not None  # the native kernel takes it
    for t in T_VALUES:
        assert_same_bits(quant_linear(x[:t], w), quant_linear_reference(x[:t], w))
    assert_same_bits(quant_linear(x[:5].float(), w, torch.float32), quant_linear_reference(x[:5].float(), w, torch.float32))


@pytest.fixture(scope="module")
def real_size():
    """(weight, input) of test_real_size_wkv, made once for both numerics (from `gen`'s seed).
    Its 157 M codes are random bytes (NaN codes made zero): every E4M3 exponent equally often,
    so magnitudes spread over 2^-9..448 and block sums round, as heavy_tailed's do, at a tenth
    of the cost of drawing and converting floats."""
    gen, n, k = torch.Generator().manual_seed(0), 25_600, 6_144
    codes = torch.frombuffer(bytearray(np.random.default_rng(0).bytes(n * k)), dtype=torch.uint8).view(n, k)
    codes.masked_fill_((codes & 0x7F) == 0x7F, 0)
    tiles = torch.randint(110, 135, (n // 32, k // 32), generator=gen, dtype=torch.uint8)
    w = QuantWeight.fp8(codes.view(torch.float8_e4m3fn), tiles.view(torch.float8_e8m0fnu))
    return w, torch.randn(7, 6_144, generator=gen).bfloat16()


def test_real_size_wkv(real_size, numerics):
    """The Engram wkv at real size: 25,600 x 6,144 FP8 with 32 x 32 tile scales."""
    w, x = real_size
    for t in (1, 7):
        assert_same_bits(quant_linear(x[:t], w), quant_linear_reference(x[:t], w))


def test_rows_do_not_depend_on_the_batch(gen):
    w = fp4_weight(200, 512, gen)
    x = heavy_tailed((70, 512), gen).bfloat16()
    full = quant_linear(x, w)
    perm = torch.randperm(70, generator=gen)
    assert_same_bits(quant_linear(x[perm], w), full[perm])
    for t in (1, 2, 5, 6, 7, 13):
        assert_same_bits(quant_linear(x[10:10 + t], w), full[10:10 + t])
    # the same row with other companions (a different tile split: 6 + 1 rows vs 4 + 3)
    other = torch.cat([heavy_tailed((6, 512), gen).bfloat16(), x[20:21]])
    assert_same_bits(quant_linear(other, w)[6], full[20])


@pytest.mark.parametrize("make", [fp8_weight, fp4_weight], ids=["fp8", "fp4"])
def test_portable_path_gives_the_same_bits(gen, make, numerics):
    w = make(100, 320, gen)
    x = heavy_tailed((9, 320), gen).bfloat16()
    vector = [quant_linear(x[:t], w) for t in (1, 4, 9)]
    block_scaled_lib.set_path("portable")  # the old name of the generic variant
    try:
        assert block_scaled_lib.path() == "generic"
        for t, want in zip((1, 4, 9), vector):
            assert_same_bits(quant_linear(x[:t], w), want)
            assert_same_bits(quant_linear_reference(x[:t], w), want)
    finally:
        block_scaled_lib.set_path("auto")


@pytest.mark.parametrize("make", [fp8_weight, fp4_weight], ids=["fp8", "fp4"])
def test_every_variant_gives_the_same_bits_at_every_tile(gen, make, numerics):
    """Every variant built (avx512bf16's VDPBF16PS tiles, avx512's FMA tiles, the raw-bits FP8
    tiles of both at T <= 4 on AMD, generic) against the reference, fp32 and bf16 out, at T = 1 ..
    12 (every register tile size, a split one, three groups: a two-group tile and a leftover), on
    fresh heavy-tailed inputs, and with a NaN and an infinity in x (there the bf16 tiles leave the
    call to the fp32 ones: test_kernel_common checks those bits across variants)."""
    w = make(96, 320, gen)
    x = heavy_tailed((12, 320), gen)
    bad = x.clone()
    bad[1, 7], bad[3, 200] = float("nan"), float("inf")
    want = {t: quant_linear_reference(x[:t], w, torch.float32) for t in range(1, 13)}
    for variant in block_scaled_lib.info()["variants_built"]:
        block_scaled_lib.set_path(variant)
        try:
            for t in range(1, 13):
                assert_same_bits(quant_linear(x[:t], w, torch.float32), want[t])
                assert_same_bits(quant_linear(x[:t].bfloat16(), w), quant_linear_reference(x[:t].bfloat16(), w))
            got = quant_linear(bad[:5], w)
            assert_same_bits(got, quant_linear_reference(bad[:5], w))
        finally:
            block_scaled_lib.set_path("auto")


def test_fma_probe_measures_a_rate_on_each_path():
    """The fp32 FMA rate (the exact sums' roof in bench_projection) comes back as a positive rate."""
    for path in block_scaled_lib.info()["variants_built"]:
        block_scaled_lib.set_path(path)
        try:
            rate = block_scaled_lib.fma_gflops(1, seconds=0.02)
        finally:
            block_scaled_lib.set_path("auto")
        assert 0 < rate < float("inf")


def test_env_var_forces_the_portable_path():
    code = "from engramflow.kernels import block_scaled_lib as b; print(b.path())"
    for name in ("portable", "generic"):
        env = {**os.environ, "ENGRAMFLOW_BLOCK_SCALED_PATH": name}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        assert out.stdout.strip() == "generic"


def test_activation_quantisation_matches(gen):
    x = heavy_tailed((6, 256), gen)
    x[0, :32] = 0  # amax floored at 1e-4
    x[1, :32] *= 1e-30  # tiny values: the E4M3 subnormal range
    x[2, 32:64] = torch.tensor([448.0 * 2 ** 60, -3.0] * 16)  # large scale
    for xx in (x, x.bfloat16()):
        q, s = block_scaled.act_quant(xx)
        q_ref, s_ref = fp8_act_quant(xx)
        assert torch.equal(s, s_ref)
        assert_same_bits(q, q_ref)


def test_weights_the_kernel_cannot_hold_fall_back_to_the_reference(gen):
    codes = (torch.randn(40, 64, generator=gen) * 50).clamp(-448, 448).to(torch.float8_e4m3fn)
    w = QuantWeight.fp8(codes, torch.rand(2, 2, generator=gen) + 0.5)  # not powers of two
    x = torch.randn(3, 64, generator=gen).bfloat16()
    assert block_scaled.linear(x, w) is None
    assert_same_bits(quant_linear(x, w), quant_linear_reference(x, w))


def test_wrong_width_is_a_clear_error(gen):
    w = fp8_weight(32, 64, gen)
    with pytest.raises(EngramflowError, match="input width 64, got 96"):
        quant_linear(torch.zeros(2, 96), w)


def test_torch_block_orders_are_the_kernels():
    """The kernel reproduces torch's block sums only where the probe recognises them; on this
    machine the probe must find an order the kernel has, else quant_linear never runs natively."""
    in_order, one_row = block_scaled.torch_block_orders()
    assert in_order and one_row in ("tree", "in-order")


def test_block_order_probe_is_safe_from_threads():
    """A projection actor projects its layers in threads, and the first calls probe at once (a
    half-filled probe result once failed one of them with a KeyError)."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    def probe(i):  # staggered over the probe's ~2 ms, so that some calls come in while it runs
        time.sleep(i * 2e-4)
        return block_scaled.torch_block_orders()

    want = block_scaled.torch_block_orders()
    for _ in range(20):
        block_scaled.torch_block_orders.cache_clear()
        with ThreadPoolExecutor(8) as pool:
            assert list(pool.map(probe, range(8))) == [want] * 8


def test_batched_numerics_sum_one_row_as_a_batch(gen):
    w = fp8_weight(100, 256, gen)
    x = heavy_tailed((4, 256), gen).bfloat16()
    with sum_order.use("batched"):
        batch = quant_linear_reference(x, w)
        for i in range(4):
            assert_same_bits(quant_linear(x[i:i + 1], w), batch[i:i + 1])
            assert_same_bits(quant_linear_reference(x[i:i + 1], w), batch[i:i + 1])
