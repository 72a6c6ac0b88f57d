"""Rows payload and stage-side projection: the stage gets the same K/V as the host would send."""
import numpy as np
import pytest
import torch

from engramflow.errors import EngramflowError
from engramflow.io.checkpoint import Checkpoint
from engramflow.kernels.mxfp8 import decode_rows
from engramflow.kernels.projection import EngramProjection
from engramflow.model.engram_memory import EngramMemory
from engramflow.model.engram_rows import EngramRows
from engramflow.model.projection_calibration import measure, random_rows
from engramflow.model.stage_projection import DeviceProjection, StageProjector
from v41_golden import V41_SMALL


def _addresses(cfg, rng, t, rows):
    return np.stack([rng.integers(0, rows, (t, cfg.engram_columns)) for _ in cfg.engram_layer_ids], axis=1)


@pytest.mark.parametrize("which", ["tiny", "v41_small"])
def test_stage_projection_equals_host_projection_bit_for_bit(which, tiny_ckpt, rng):
    ckpt = Checkpoint(tiny_ckpt if which == "tiny" else V41_SMALL)
    numerics = "official" if which == "v41_small" else "fast"
    cfg = ckpt.config
    memory = EngramMemory(ckpt, numerics=numerics)
    stage = StageProjector(ckpt.tensor, cfg, cfg.engram_layer_ids, "cpu", numerics)
    rows = min(t.rows for t in memory.tables.values())
    for t in (1, 3, 70):  # decode GEMV and prefill GEMM regimes
        addr = _addresses(cfg, rng, t, rows)
        for layer in cfg.engram_layer_ids:
            payload = memory.rows(layer, addr)
            assert payload.nbytes == t * cfg.engram_columns * (cfg.engram_head_dim + cfg.engram_head_dim // 32)
            key, value = memory.project(layer, addr)
            k2, v2 = stage.project(layer, payload)
            assert torch.equal(key, k2) and torch.equal(value, v2)
    memory.close()
    ckpt.close()


def test_rows_decode_on_any_device_gives_the_native_bits():
    rows = random_rows(9, 24, 256, seed=3)
    native = rows.decode(torch.bfloat16, "cpu")
    portable = decode_rows(torch.from_numpy(rows.codes), torch.from_numpy(rows.scales), torch.bfloat16).view(9, -1)
    assert torch.equal(native, portable)


@pytest.mark.parametrize("numerics", ["fast", "official"])
def test_the_device_projection_matches_the_host_kernels(numerics):
    """The GPU path's arithmetic (run here on CPU tensors): official is the same quantised GEMM,
    fast a BF16 GEMM (K/V to BF16 rounding)."""
    g = torch.Generator().manual_seed(0)
    hc, dim, cols = 2, 64, 256
    codes = torch.randint(0, 256, (dim * (hc + 1), cols), dtype=torch.uint8, generator=g)
    codes[(codes & 0x7F) == 0x7F] = 0x7E
    scale = torch.randint(118, 124, (dim * (hc + 1) // 32, cols // 32), dtype=torch.uint8, generator=g)
    x = torch.randn(37, cols, generator=g).bfloat16()
    host = EngramProjection(codes, scale, hc, dim, numerics=numerics)
    dev = DeviceProjection(codes, scale, hc, dim, torch.device("cpu"), numerics)
    (k1, v1), (k2, v2) = host.project(x), dev.project(x)
    if numerics == "official":
        assert torch.equal(k1, k2) and torch.equal(v1, v2)
    else:
        torch.testing.assert_close(k2, k1, rtol=1e-2, atol=1e-2 * float(k1.abs().max()))
        torch.testing.assert_close(v2, v1, rtol=1e-2, atol=1e-2 * float(v1.abs().max()))


def test_bad_rows_are_refused(tiny_ckpt):
    with pytest.raises(EngramflowError, match="Engram rows must be codes u8"):
        EngramRows(np.zeros((2, 24, 256), np.uint8), np.zeros((2, 24, 4), np.uint8))
    ckpt = Checkpoint(tiny_ckpt)
    cfg = ckpt.config
    stage = StageProjector(ckpt.tensor, cfg, [cfg.engram_layer_ids[0]], "cpu")
    with pytest.raises(EngramflowError, match=f"not {cfg.engram_layer_ids[1]}"):
        stage.project(cfg.engram_layer_ids[1], random_rows(1, cfg.engram_columns, cfg.engram_head_dim))
    with pytest.raises(EngramflowError, match="must be"):
        stage.project(cfg.engram_layer_ids[0], random_rows(1, cfg.engram_columns + 1, cfg.engram_head_dim))
    ckpt.close()


def test_measure_reports_both_regimes():
    m = measure(lambda t: torch.ones(t, 64) @ torch.ones(64, 64), tokens=32, repeat=1)
    assert m["tokens"] == 32 and m["decode_s"] > 0 and m["per_token_s"] > 0
