"""MXFP8 decode: every (E8M0 scale, E4M3 code) pair vs a scalar reference, gather == decode
then index, native kernel == numpy path bit for bit, and a clean fallback without a compiler."""
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from engramflow.errors import EngramflowError
from engramflow.kernels import formats, mxfp8, native

NATIVE = native.library() is not None
BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16}
CANONICAL_NAN = {torch.float32: 0x7FC00000, torch.bfloat16: 0x7FC0}


def e4m3_scalar(b: int) -> float:
    """E4M3 (fn) by its definition: bias 7, no infinities, S.1111.111 is NaN."""
    sign = -1.0 if b & 0x80 else 1.0
    exp, man = (b >> 3) & 0xF, b & 0x7
    if exp == 15 and man == 7:
        return math.nan
    if exp == 0:
        return sign * man / 8 * 2.0 ** -6
    return sign * (1 + man / 8) * 2.0 ** (exp - 7)


def e8m0_scalar(s: int) -> float:
    return math.nan if s == 255 else math.ldexp(1.0, s - 127)


def reference_bits(dtype: torch.dtype) -> torch.Tensor:
    """[256 scales, 256 codes] rounded once from the exact float64 product into dtype, as bits."""
    exact = torch.tensor([[e8m0_scalar(s) * e4m3_scalar(b) for b in range(256)] for s in range(256)],
                         dtype=torch.float64)
    vals = exact.to(dtype)
    bits = vals.view(BITS[dtype]).clone()
    nan = torch.tensor(CANONICAL_NAN[dtype], dtype=torch.int32).to(BITS[dtype])
    bits[torch.isnan(exact)] = nan
    return bits


def all_pairs_table():
    """256 rows: row s has scale byte s in all 8 blocks and codes 0..255 in order."""
    codes = np.tile(np.arange(256, dtype=np.uint8), (256, 1))
    scales = np.repeat(np.arange(256, dtype=np.uint8)[:, None], 8, axis=1)
    return codes, scales


def test_e4m3_table_matches_definition():
    ref = np.array([e4m3_scalar(b) for b in range(256)])
    assert np.array_equal(formats.E4M3_F64, ref, equal_nan=True)
    assert formats.E4M3_F64[0x7E] == 448 and formats.E4M3_F64[0x01] == 2.0 ** -9  # max and smallest subnormal
    assert np.isnan(formats.E4M3_F64[[0x7F, 0xFF]]).all()
    codes = torch.arange(256, dtype=torch.uint8)
    assert torch.equal(torch.isnan(formats.e4m3_to_float32(codes)), torch.from_numpy(np.isnan(ref)))
    ok = ~np.isnan(ref)
    assert np.array_equal(formats.e4m3_to_float32(codes).double().numpy()[ok], ref[ok])
    assert torch.equal(formats.e4m3_to_float32(codes.view(torch.float8_e4m3fn)).nan_to_num(),
                       formats.e4m3_to_float32(codes).nan_to_num())
    nan_bits = formats.e4m3_to_float32(codes).view(torch.int32)[[0x7F, 0xFF]]
    assert nan_bits.tolist() == [0x7FC00000] * 2  # both NaN codes: the one NaN, whatever the cast's payload


def e2m1_scalar(code: int) -> float:
    """E2M1 by its definition: sign bit 3, exponent bits 1-2 (bias 1), mantissa bit 0."""
    sign, exp, man = code >> 3, (code >> 1) & 3, code & 1
    mag = man * 0.5 if exp == 0 else 2.0 ** (exp - 1) * (1 + man / 2)
    return -mag if sign else mag


def test_e2m1_bytes_decode_to_their_two_values_low_nibble_first():
    packed = torch.arange(256, dtype=torch.uint8).view(16, 16)
    got = formats.e2m1_values(packed)
    want = torch.tensor([[e2m1_scalar(b & 0xF), e2m1_scalar(b >> 4)] for b in range(256)]).view(16, 32)
    assert got.shape == (16, 32) and torch.equal(got.view(torch.int32), want.view(torch.int32))  # -0.0 too


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("path", ["native", "numpy", "decode_rows"])
def test_every_scale_and_code_vs_scalar_reference(dtype, path):
    if path == "native" and not NATIVE:
        pytest.skip("no C compiler here: the native kernel is not built")
    codes, scales = all_pairs_table()
    addresses = np.arange(256, dtype=np.int64).reshape(8, 32)
    if path == "native":
        got = mxfp8.gather_decode(codes, scales, addresses, dtype)
    elif path == "numpy":
        got = mxfp8.gather_decode_numpy(codes, scales, addresses, dtype)
    else:
        got = mxfp8.decode_rows(torch.from_numpy(codes), torch.from_numpy(scales), dtype)
    assert torch.equal(got.reshape(256, 256).view(BITS[dtype]), reference_bits(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_equals_decode_then_index(rng, dtype):
    rows, d = 300, 256
    codes = rng.integers(0, 256, (rows, d), dtype=np.uint8)
    scales = rng.integers(0, 256, (rows, d // 32), dtype=np.uint8)
    whole = mxfp8.decode_rows(torch.from_numpy(codes), torch.from_numpy(scales), dtype)
    addresses = rng.integers(0, rows, (5, 24))
    expected = whole[torch.from_numpy(addresses).reshape(-1)].reshape(5, 24 * d)
    for got in (mxfp8.gather_decode(codes, scales, addresses, dtype),
                mxfp8.gather_decode_numpy(codes, scales, addresses, dtype),
                mxfp8.gather_decode(codes, scales, addresses, dtype, out=torch.empty(5, 24 * d, dtype=dtype))):
        assert torch.equal(got.view(BITS[dtype]), expected.view(BITS[dtype]))


def test_gather_from_read_only_memmap(tmp_path, rng):
    rows, d = 64, 256
    codes = rng.integers(0, 256, (rows, d), dtype=np.uint8)
    scales = rng.integers(100, 150, (rows, d // 32), dtype=np.uint8)
    codes.tofile(tmp_path / "codes.bin")
    scales.tofile(tmp_path / "scales.bin")
    mc = np.memmap(tmp_path / "codes.bin", dtype=np.uint8, mode="r", shape=(rows, d))
    ms = np.memmap(tmp_path / "scales.bin", dtype=np.uint8, mode="r", shape=(rows, d // 32))
    addresses = rng.integers(0, rows, (2, 24))
    got = mxfp8.gather_decode(mc, ms, addresses, torch.bfloat16)
    assert torch.equal(got.view(torch.int16), mxfp8.gather_decode_numpy(codes, scales, addresses, torch.bfloat16).view(torch.int16))


@pytest.mark.parametrize("bad", [-1, 64, 10**12])
@pytest.mark.parametrize("fn", [mxfp8.gather_decode, mxfp8.gather_decode_numpy])
def test_out_of_range_address_is_named(fn, bad):
    codes = np.zeros((64, 256), np.uint8)
    scales = np.full((64, 8), 127, np.uint8)
    addresses = np.zeros((1, 24), np.int64)
    addresses[0, 7] = bad
    with pytest.raises(EngramflowError, match=str(bad)):
        fn(codes, scales, addresses)


def test_dequant_blocks_scale_layouts(rng):
    r, c = 64, 96
    codes = torch.from_numpy(rng.integers(0, 256, (r, c), dtype=np.uint8))
    codes[(codes & 0x7F) == 0x7F] = 0x38
    for br, bc in [(32, 32), (16, 48), (64, 96)]:
        s = torch.from_numpy(rng.integers(110, 140, (r // br, c // bc), dtype=np.uint8))
        ref = formats.E4M3_F64[codes.numpy()] * np.repeat(np.repeat(formats.e8m0_to_float(s).double().numpy(), br, 0), bc, 1)
        got = formats.dequant_blocks(codes, s, torch.float32)
        assert np.array_equal(got.double().numpy(), ref)
        # bf16 is exact for these scales; float8 input and F32 scales give the same numbers
        assert torch.equal(formats.dequant_blocks(codes.view(torch.float8_e4m3fn), s).float(), got)
        assert torch.equal(formats.dequant_blocks(codes, formats.e8m0_to_float(s),
                                                torch.float32), got)
    with pytest.raises(EngramflowError, match="scale"):
        formats.dequant_blocks(codes, torch.ones(5, 3, dtype=torch.uint8))


def test_falls_back_cleanly_without_a_compiler(tmp_path):
    """A fresh process whose compiler is missing gets the numpy path and the same bits."""
    script = (
        "import numpy as np, torch\n"
        "from engramflow.kernels import formats, mxfp8, native\n"
        "assert native.library() is None\n"
        "rng = np.random.default_rng()\n"
        "codes = rng.integers(0, 256, (50, 256), dtype=np.uint8)\n"
        "scales = rng.integers(0, 256, (50, 8), dtype=np.uint8)\n"
        "a = rng.integers(0, 50, (3, 24))\n"
        "got = mxfp8.gather_decode(codes, scales, a, torch.bfloat16)\n"
        "ref = mxfp8.decode_rows(torch.from_numpy(codes[a.reshape(-1)]), torch.from_numpy(scales[a.reshape(-1)]), torch.bfloat16)\n"
        "assert torch.equal(got.view(torch.int16), ref.reshape(3, -1).view(torch.int16))\n"
        "print('fallback ok')\n"
    )
    # REBUILD: skip the library built at install time, so the (missing) compiler is what is tried
    env = dict(os.environ, CC=str(tmp_path / "no-such-compiler"), ENGRAMFLOW_CACHE=str(tmp_path / "cache"),
               ENGRAMFLOW_REBUILD="1")
    env.pop("ENGRAMFLOW_NO_NATIVE", None)
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "fallback ok" in proc.stdout
