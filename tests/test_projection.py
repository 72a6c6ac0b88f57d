"""Engram wkv projection vs a float64 reference in both regimes (native GEMV for decode, tiled
FP32 GEMM for prefill), with and without the native kernels (packed and row-major FP8 layouts);
head/column order end to end."""
import numpy as np
import pytest
import torch

from engramflow.errors import EngramflowError
from engramflow.kernels import formats, mxfp8, native
from engramflow.kernels.projection import EngramProjection, pack_rows
from engramflow.io.config import from_dict
from engramflow.io.presets import PRESETS

NATIVE = native.library() is not None
HC, DIM, C = 4, 64, 1024  # R = 320 rows: small, but the real block structure
R = DIM * (HC + 1)


def random_fp8(rng, rows=R, cols=C, block=(32, 128), f32_scale=False):
    codes = torch.from_numpy(rng.integers(0, 256, (rows, cols), dtype=np.uint8))
    codes[(codes & 0x7F) == 0x7F] = 0x3F  # real weights hold no NaN codes
    s = rng.integers(112, 124, (rows // block[0], cols // block[1]), dtype=np.uint8)
    scale = formats.e8m0_to_float(torch.from_numpy(s)) if f32_scale else torch.from_numpy(s)
    return codes, scale


def reference(x: torch.Tensor, w64: torch.Tensor):
    kv = x.double() @ w64.t()
    return kv[:, : HC * DIM].reshape(-1, HC, DIM), kv[:, HC * DIM:]


def rel_err(got, ref) -> float:
    return ((got.double() - ref).abs().max() / ref.abs().max()).item()


def modes():
    """native (FP8 rows packed at load, the default), native with row-major FP8, torch only"""
    return ["native", "native-rows", "torch"] if NATIVE else ["torch"]


def make(mode, weight, scale, hc, dim, **kwargs) -> EngramProjection:
    proj = EngramProjection(weight, scale, hc, dim, use_native=mode != "torch", pack=mode == "native", **kwargs)
    assert proj.uses_native == (mode != "torch")
    return proj


@pytest.mark.parametrize("mode", modes())
@pytest.mark.parametrize("weights", ["fp8_e8m0_32x128", "fp8_e8m0_32x32", "fp8_f32", "float8_dtype", "bf16"])
def test_matches_float64_reference_in_both_regimes(rng, mode, weights):
    if weights == "bf16":
        weight, scale = torch.from_numpy(rng.standard_normal((R, C), dtype=np.float32)).bfloat16(), None
        w64 = weight.double()
    else:
        block = (32, 32) if weights == "fp8_e8m0_32x32" else (32, 128)
        weight, scale = random_fp8(rng, block=block, f32_scale=weights == "fp8_f32")
        w64 = formats.dequant_blocks(weight, scale, torch.float32).double()
        if weights == "float8_dtype":
            weight = weight.view(torch.float8_e4m3fn)
    proj = make(mode, weight, scale, HC, DIM, decode_max_tokens=8)
    assert proj.group == (8 if mode == "native" and weights != "bf16" else 1)
    for t in (1, 2, 4, 8, 9, 37):  # 1..8 decode regime, 9 and 37 prefill
        x = torch.from_numpy(rng.standard_normal((t, C), dtype=np.float32))
        key, value = proj.project(x)
        ref_key, ref_value = reference(x, w64)
        assert key.shape == (t, HC, DIM) and value.shape == (t, DIM)
        assert key.dtype == value.dtype == torch.float32 and key.is_contiguous() and value.is_contiguous()
        assert rel_err(key, ref_key) <= 1e-5, (t, rel_err(key, ref_key))
        assert rel_err(value, ref_value) <= 1e-5, (t, rel_err(value, ref_value))
        xb = x.bfloat16()  # bf16 input: compared with the fp32 reference of the unrounded x
        kb, vb = proj.project(xb)
        assert rel_err(kb, ref_key) <= 1e-2 and rel_err(vb, ref_value) <= 1e-2


def test_forced_bf16_prefill_matmul(rng):
    """The native-BF16 CPU path (AMX / avx512_bf16) runs anywhere when forced; bf16 precision."""
    weight, scale = random_fp8(rng)
    w64 = formats.dequant_blocks(weight, scale, torch.float32).double()
    proj = EngramProjection(weight, scale, HC, DIM, prefill="bf16", decode_max_tokens=1)
    x = torch.from_numpy(rng.standard_normal((20, C), dtype=np.float32)).bfloat16()
    key, value = proj.project(x)
    ref_key, ref_value = reference(x.float(), w64)
    assert rel_err(key, ref_key) <= 1e-2 and rel_err(value, ref_value) <= 1e-2


@pytest.mark.skipif(not NATIVE, reason="no C compiler here: the native kernels are not built")
def test_thread_count_does_not_change_results(rng):
    weight, scale = random_fp8(rng)
    x = torch.from_numpy(rng.standard_normal((3, C), dtype=np.float32))
    one = EngramProjection(weight, scale, HC, DIM, threads=1).project(x)
    for n in (2, 4):  # threads started in C, claiming 64-row grains (R = 320: 5 grains)
        many = EngramProjection(weight, scale, HC, DIM, threads=n).project(x)
        assert torch.equal(one[0], many[0]) and torch.equal(one[1], many[1])


@pytest.mark.parametrize("mode", modes())
def test_head_and_column_order(rng, mode):
    """Rows that encode their own column index, gathered and projected: the input's block c
    holds column c, key[t, s] is output rows [s*dim, (s+1)*dim) and value the last dim."""
    cols, d = 24, 256
    c_in = cols * d
    # table row for column c: every value is 2^(c-12) (code 0x38 = 1.0, scale byte 115 + c)
    codes = np.full((cols, d), 0x38, np.uint8)
    scales = np.repeat((115 + np.arange(cols, dtype=np.uint8))[:, None], d // 32, axis=1)
    addresses = np.tile(np.arange(cols, dtype=np.int64), (2, 1))
    x = mxfp8.gather_decode(codes, scales, addresses, torch.float32)
    for c in range(cols):
        assert torch.all(x[:, c * d:(c + 1) * d] == 2.0 ** (c - 12))
    # weight: output row r reads input column block (r % 24) only, with weight 1.0 on its first value
    hc, dim = 4, 48
    rows = dim * (hc + 1)
    weight = np.zeros((rows, c_in), np.uint8)
    weight[np.arange(rows), (np.arange(rows) % cols) * d] = 0x38
    scale = np.full((rows // 16, c_in // 128), 127, np.uint8)
    proj = make(mode, torch.from_numpy(weight), torch.from_numpy(scale), hc, dim)
    for t_x in (x, x.repeat(20, 1)):  # decode and prefill regimes
        key, value = proj.project(t_x)
        expect = 2.0 ** (torch.arange(rows) % cols - 12).double()
        for s in range(hc):
            assert torch.equal(key[0, s].double(), expect[s * dim:(s + 1) * dim])
        assert torch.equal(value[0].double(), expect[hc * dim:])


def test_nan_codes_take_the_exact_torch_path(rng):
    weight, scale = random_fp8(rng)
    weight[5, 7] = 0x7F
    proj = EngramProjection(weight, scale, HC, DIM)
    assert not proj.uses_native
    key, value = proj.project(torch.ones(1, C))
    flat = torch.cat([key.reshape(1, -1), value], 1)
    assert torch.isnan(flat[0, 5]) and torch.isfinite(flat[0, :5]).all() and torch.isfinite(flat[0, 6:]).all()


def test_from_checkpoint_and_bad_input(rng):
    cfg = from_dict(dict(PRESETS["deepseek-v4.1-flash"]) | {"dim": 64, "engram_n_heads": 2, "engram_max_ngram_size": 3})
    c_in, rows = cfg.engram_input_dim, cfg.engram_output_dim
    weight, scale = random_fp8(rng, rows=rows, cols=c_in, block=(32, 128))
    tensors = {"layers.1.engram.wkv.weight": weight, "layers.1.engram.wkv.scale": scale}
    proj = EngramProjection.from_checkpoint(tensors.__getitem__, 1, cfg)
    x = torch.from_numpy(rng.standard_normal((2, c_in), dtype=np.float32))
    key, value = proj.project(x)
    assert key.shape == (2, cfg.hc_mult, cfg.dim) and value.shape == (2, cfg.dim)
    bf16 = {"layers.14.engram.wkv.weight": formats.dequant_blocks(weight, scale)}
    k2, v2 = EngramProjection.from_checkpoint(bf16.__getitem__, 14, cfg).project(x)
    assert torch.allclose(k2, key, rtol=1e-5, atol=1e-5 * key.abs().max().item())
    with pytest.raises(EngramflowError, match="scale is missing"):
        EngramProjection.from_checkpoint({"layers.1.engram.wkv.weight": weight}.__getitem__, 1, cfg)
    with pytest.raises(EngramflowError, match=r"\[320, 256\]"):
        EngramProjection.from_checkpoint({"layers.1.engram.wkv.weight": weight[:, :256]}.__getitem__, 1, cfg)
    with pytest.raises(EngramflowError, match=r"\[3, 5\]"):
        proj.project(torch.zeros(3, 5))
    with pytest.raises(EngramflowError, match="rows"):
        EngramProjection(weight, scale, 3, cfg.dim)
    with pytest.raises(EngramflowError, match="scale"):
        EngramProjection(weight, None, cfg.hc_mult, cfg.dim)
    with pytest.raises(EngramflowError, match="float16"):
        EngramProjection(weight.half(), None, cfg.hc_mult, cfg.dim)
    empty_k, empty_v = proj.project(torch.zeros(0, c_in))
    assert empty_k.shape == (0, cfg.hc_mult, cfg.dim) and empty_v.shape == (0, cfg.dim)


@pytest.mark.skipif(not NATIVE, reason="native kernels unavailable")
@pytest.mark.parametrize("block", [(32, 128), (32, 32)])
def test_multi_token_decode_subnormal_codes_and_extreme_x(rng, block):
    """The T >= 2 native GEMV (bit-trick decode, each token pre-scaled by its own 2^a): subnormal
    E4M3 codes, tiny/huge/mixed-magnitude tokens, T across 2..64 incl. partial token groups."""
    weight, scale = random_fp8(rng, block=block)
    sub = torch.from_numpy(rng.random((R, C)) < 0.5)
    weight[sub] = weight[sub] & 0x87  # exponent 0: subnormal (or zero) codes
    weight[:8] = weight[:8] & 0x87     # rows of subnormal codes only
    w64 = formats.dequant_blocks(weight, scale, torch.float32).double()
    proj = EngramProjection(weight, scale, HC, DIM, use_native=True, decode_max_tokens=64)
    for t in (2, 3, 4, 5, 7, 8, 13, 16, 33, 64):
        x = torch.from_numpy(rng.standard_normal((t, C), dtype=np.float32))
        mags = [1.0, 1e-30, 1e30, 1e-38, 1e33]  # outputs stay finite in fp32
        for i in range(t):
            x[i] *= mags[i % len(mags)]
        x[-1, ::2] = 0.0
        key, value = proj.project(x)
        got = torch.cat([key.reshape(t, -1), value], 1).double()
        ref = x.double() @ w64.t()
        for i in range(t):  # per token: tokens differ by up to 1e68 in magnitude
            err = ((got[i] - ref[i]).abs().max() / ref[i].abs().max()).item()
            assert err <= 1e-5, (t, i, err)


def test_pack_rows_places_every_code():
    """pack_rows is the layout native_kernels.c reads: code (r, c) at [r/8, c/32, r%8, c%32]."""
    rows, cols = 48, 96
    codes = torch.arange(rows * cols, dtype=torch.int64).remainder(251).to(torch.uint8).view(rows, cols)
    packed = pack_rows(codes)
    assert packed.shape == (rows // 8, cols // 32, 8, 32) and packed.is_contiguous()
    r, c = np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij")
    assert torch.equal(packed[r // 8, c // 32, r % 8, c % 32], codes)
    with pytest.raises(EngramflowError, match="44 x 96"):
        pack_rows(codes[:44])
    with pytest.raises(EngramflowError, match="48 x 80"):
        pack_rows(codes[:, :80])


@pytest.mark.skipif(not NATIVE, reason="native kernels unavailable")
@pytest.mark.parametrize("block", [(32, 128), (32, 32)])
def test_packed_and_row_major_layouts_agree_bit_for_bit(rng, block):
    """Same codes, same arithmetic in the same order: every decode kernel (T = 1, the few-token
    group kernel, the row-tile kernel) and the prefill tiles give identical bits either way."""
    weight, scale = random_fp8(rng, block=block)
    packed = EngramProjection(weight, scale, HC, DIM, threads=2)
    rows = EngramProjection(weight, scale, HC, DIM, threads=2, pack=False)
    assert (packed.group, rows.group) == (8, 1)
    assert packed.weight_bytes == rows.weight_bytes
    for t in (1, 2, 3, 4, 5, 8, 9, 16, 33, 64, 70):
        x = torch.from_numpy(rng.standard_normal((t, C), dtype=np.float32))
        (kp, vp), (kr, vr) = packed.project(x), rows.project(x)
        assert torch.equal(kp, kr) and torch.equal(vp, vr), t


@pytest.mark.skipif(not NATIVE, reason="native kernels unavailable")
def test_rows_not_a_multiple_of_the_group_stay_row_major(rng):
    hc, dim = 2, 20  # 60 rows
    weight, scale = random_fp8(rng, rows=60, block=(20, 128))
    proj = EngramProjection(weight, scale, hc, dim)
    assert proj.uses_native and proj.group == 1
    x = torch.from_numpy(rng.standard_normal((3, C), dtype=np.float32))
    kv = x.double() @ formats.dequant_blocks(weight, scale, torch.float32).double().t()
    key, value = proj.project(x)
    assert rel_err(torch.cat([key.reshape(3, -1), value], 1), kv) <= 1e-5


@pytest.mark.skipif(not NATIVE, reason="native kernels unavailable")
@pytest.mark.parametrize("pack", [True, False])
@pytest.mark.parametrize("block_rows", [32, 64])
def test_single_token_decode_with_extreme_scales_and_inputs(rng, pack, block_rows):
    """T = 1 with row blocks of 64+ rows folds each row block's scales into x (rescaled by 2^k);
    shorter row blocks scale per-block partial sums. Either way: fp32 block scales over
    2^-40..2^30, subnormal codes, x over 35 decades, all-zero blocks; inf/NaN in x propagate as
    in the float64 reference (an inf turns folding off: it could overflow other blocks)."""
    weight, _ = random_fp8(rng)
    sub = torch.from_numpy(rng.random((R, C)) < 0.3)
    weight[sub] = weight[sub] & 0x87
    scale = torch.from_numpy(np.ldexp(1.0, rng.integers(-40, 31, (R // block_rows, C // 128))).astype(np.float32))
    scale *= torch.from_numpy(rng.uniform(1, 2, scale.shape).astype(np.float32))  # not powers of two
    w64 = formats.dequant_blocks(weight, scale, torch.float32).double()
    proj = EngramProjection(weight, scale, HC, DIM, threads=2, pack=pack)
    x = torch.from_numpy(rng.standard_normal((1, C)) * 10.0 ** rng.uniform(-20, 15, (1, C))).float()
    x[0, 128:256] = 0.0  # a whole column block of zeros
    key, value = proj.project(x)
    got = torch.cat([key.reshape(1, -1), value], 1).double()
    ref = x.double() @ w64.t()
    assert ref.abs().max() < 1e36  # the exact results fit fp32
    err = ((got - ref).abs().max() / ref.abs().max()).item()
    assert err <= 1e-5, err
    zero_k, zero_v = proj.project(torch.zeros(1, C))
    assert not zero_k.any() and not zero_v.any()
    x_bad = torch.from_numpy(rng.standard_normal((1, C), dtype=np.float32))
    x_bad[0, 5], x_bad[0, 700] = float("inf"), float("nan")
    key, value = proj.project(x_bad)
    got = torch.cat([key.reshape(1, -1), value], 1)
    assert torch.isnan(got).all()  # every row meets the NaN column (no zero*NaN escapes)
    x_inf = torch.from_numpy(rng.standard_normal((1, C), dtype=np.float32))
    x_inf[0, 5] = float("inf")
    x_inf[0, 300] = 1e36  # another block that a folded factor would overflow
    key, value = proj.project(x_inf)
    got = torch.cat([key.reshape(1, -1), value], 1)
    ref = x_inf.double() @ w64.t()
    assert torch.equal(torch.isnan(got), torch.isnan(ref)) and torch.equal(torch.isinf(got), torch.isinf(ref))


@pytest.mark.skipif(not NATIVE, reason="native kernels unavailable")
def test_single_token_decode_scales_beyond_fp32_range_of_each_other(rng):
    """Two column blocks whose scales differ by 2^244 (the most fp32 weights allow) and whose
    inputs differ by 2^-244, so both contribute alike: folding the scales into x (row blocks of
    64 rows) needs a factor outside fp32's range for one block (computed in double). Reference
    in float64 from the exact codes and scales. (Unfolded, the small block would underflow: x
    is pre-scaled only as far as its largest value allows.)"""
    weight, _ = random_fp8(rng)
    u = rng.uniform(1, 2, (R // 64, C // 128))
    scale = np.ones((R // 64, C // 128))
    scale[:, 0], scale[:, 1] = np.ldexp(u[:, 0], -126), np.ldexp(u[:, 1], 118)
    scale = torch.from_numpy(scale.astype(np.float32))
    x = torch.zeros(1, C)
    x[0, :128] = torch.from_numpy(np.ldexp(rng.uniform(1, 2, 128), 121)).float()
    x[0, 128:256] = torch.from_numpy(np.ldexp(rng.uniform(1, 2, 128), -123)).float()
    w64 = formats.e4m3_to_float32(weight).double() * scale.double().repeat_interleave(64, 0).repeat_interleave(128, 1)
    ref = x.double() @ w64.t()
    both = (x.double()[:, :128] @ w64[:, :128].t()).abs() / (x.double()[:, 128:256] @ w64[:, 128:256].t()).abs()
    assert 1e-3 < both.median() < 1e3  # the two blocks really are of one size
    for pack in (True, False):
        key, value = EngramProjection(weight, scale, HC, DIM, pack=pack).project(x)
        got = torch.cat([key.reshape(1, -1), value], 1).double()
        assert ((got - ref).abs().max() / ref.abs().max()).item() <= 1e-5


SAFE_DECODE_SCRIPT = """
import sys, numpy as np, torch
sys.path.insert(0, {tests!r})
from test_projection import HC, DIM, C, R, random_fp8
from engramflow.kernels.projection import EngramProjection
rng = np.random.default_rng(7)
outs = []
for block, pack in (((32, 128), True), ((32, 32), False)):
    weight, scale = random_fp8(rng, block=block)
    sub = torch.from_numpy(rng.random((R, C)) < 0.3)
    weight[sub] = weight[sub] & 0x87  # exponent 0: subnormal (or zero) codes
    proj = EngramProjection(weight, scale, HC, DIM, use_native=True, pack=pack, decode_max_tokens=64)
    for t in (1, 2, 5, 16):
        x = torch.from_numpy(rng.standard_normal((t, C), dtype=np.float32))
        x[0] *= 1e-30
        key, value = proj.project(x)
        outs.append(torch.cat([key.reshape(t, -1), value], 1).numpy().view(np.uint32).ravel())
np.save({out!r}, np.concatenate(outs))
"""


@pytest.mark.skipif(not NATIVE, reason="native kernels unavailable")
def test_subnormal_safe_decode_gives_the_same_bits(tmp_path):
    """Where subnormal multiplies are slow (Intel), the GEMV decodes E4M3 lanes 2^16 higher and
    fixes subnormal codes with one FMA; the library measures which once per process. Both ways,
    forced by ENGRAMFLOW_SUBNORMAL_SAFE in a process each, give the same output bits (T = 1 and
    T >= 2, packed and row-major, many subnormal codes, a tiny token)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    bits = {}
    for mode in ("0", "1"):
        out = tmp_path / f"safe{mode}.npy"
        script = SAFE_DECODE_SCRIPT.format(tests=str(Path(__file__).parent), out=str(out))
        subprocess.run([sys.executable, "-c", script], check=True, env=os.environ | {"ENGRAMFLOW_SUBNORMAL_SAFE": mode})
        bits[mode] = np.load(out)
    assert bits["0"].size > 0 and np.array_equal(bits["0"], bits["1"])
