"""Engram gating vs a straightforward per-stream fp32 implementation; masks; devices."""
import math

import numpy as np
import pytest
import torch

from engramflow.errors import EngramflowError
from engramflow.kernels.gating import EngramGate

HC, DIM = 4, 96


def straightforward(h, key, value, q, k, eps=1e-6, mask=None):
    """The gating of docs/v41.md ("Engram") written out per position and stream, in fp32."""
    h, key, value = h.float(), key.float(), value.float()
    out = h.clone()
    for t in range(h.shape[0]):
        if mask is not None and mask[t]:
            continue
        for s in range(h.shape[1]):
            w = q[s].float() * k[s].float()
            rstd = torch.rsqrt((h[t, s] ** 2).mean() + eps) * torch.rsqrt((key[t, s] ** 2).mean() + eps)
            dot = (h[t, s] * w * key[t, s]).sum() * rstd / math.sqrt(h.shape[2])
            gate = torch.sigmoid(torch.copysign(torch.sqrt(torch.clamp(dot.abs(), min=1e-6)), dot))
            out[t, s] = h[t, s] + gate * value[t]
    return out


def inputs(rng, t, dtype=torch.float32):
    g = lambda *shape: torch.from_numpy(rng.standard_normal(shape, dtype=np.float32))
    return g(t, HC, DIM).to(dtype), g(t, HC, DIM), g(t, DIM), g(HC, DIM), g(HC, DIM)


def test_matches_straightforward_fp32(rng):
    h, key, value, q, k = inputs(rng, 7)
    got = EngramGate(q, k)(h, key, value)
    ref = straightforward(h, key, value, q, k)
    assert got.dtype == torch.float32
    assert ((got - ref).abs().max() / ref.abs().max()).item() <= 1e-6


def test_bf16_hidden_state_and_weights(rng):
    h, key, value, q, k = inputs(rng, 5, torch.bfloat16)
    gate = EngramGate(q.bfloat16(), k.bfloat16())
    got = gate(h, key.bfloat16(), value.bfloat16())
    ref = straightforward(h, key.bfloat16(), value.bfloat16(), q.bfloat16(), k.bfloat16())
    assert got.dtype == torch.bfloat16
    # the fp32 results agree to 1e-6; the one cast to bf16 may differ by one bf16 ulp
    assert torch.allclose(got.float(), ref.to(torch.bfloat16).float(), rtol=2 ** -7, atol=0)


def test_masked_rows_are_bit_identical_and_input_untouched(rng):
    h, key, value, q, k = inputs(rng, 6)
    h[1, 2, 3] = -0.0  # h + 0*value would turn this into +0.0
    value[4, 0] = float("inf")  # and 0*inf into NaN
    before = h.clone()
    mask = torch.tensor([False, True, False, False, True, False])
    got = EngramGate(q, k)(h, key, value, mask)
    assert torch.equal(h.view(torch.int32), before.view(torch.int32))  # a new tensor, h unchanged
    assert got.data_ptr() != h.data_ptr()
    assert torch.equal(got[mask].view(torch.int32), h[mask].view(torch.int32))
    ref = straightforward(h, key, value, q, k, mask=mask)
    keep = ~mask
    assert ((got[keep] - ref[keep]).abs().max() / ref[keep].abs().max()).item() <= 1e-6


def test_gate_uses_signed_square_root(rng):
    """Tiny and negative dots: |dot| clamps at 1e-6 and the sign survives."""
    h, key, value, q, k = inputs(rng, 3)
    key[0] = 0.0  # dot = 0 -> gate = sigmoid(+sqrt(1e-6))
    got = EngramGate(q, k)(h, key, value)
    expect0 = h[0] + torch.sigmoid(torch.tensor(1e-3)) * value[0]
    assert torch.allclose(got[0], expect0, rtol=1e-6, atol=1e-6)
    flipped = EngramGate(-q, k)(h, key, value)  # negating w negates every dot
    assert torch.allclose(flipped[1:], straightforward(h, key, value, -q, k)[1:], rtol=1e-6, atol=1e-6)


def test_bad_shapes_are_named(rng):
    h, key, value, q, k = inputs(rng, 2)
    gate = EngramGate(q, k)
    with pytest.raises(EngramflowError, match=r"\[2, 4, 95\]"):
        gate(h[..., :95], key, value)
    with pytest.raises(EngramflowError, match="value"):
        gate(h, key, value[:1])
    with pytest.raises(EngramflowError, match="mask"):
        gate(h, key, value, torch.zeros(2, dtype=torch.int64))
    with pytest.raises(EngramflowError, match="gate weights"):
        EngramGate(q, k[:3])


def test_to_cpu_keeps_results(rng):
    h, key, value, q, k = inputs(rng, 3)
    gate = EngramGate(q, k)
    assert torch.equal(gate.to("cpu")(h, key, value), gate(h, key, value))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_matches_cpu(rng):
    h, key, value, q, k = inputs(rng, 9)
    mask = torch.tensor([i % 3 == 0 for i in range(9)])
    gate = EngramGate(q, k)
    cpu = gate(h, key, value, mask)
    for dtype in (torch.float32, torch.bfloat16):
        hd = h.to(dtype).cuda()
        # key/value may still live on the CPU (projected there): moved to h's device
        got = gate.to("cuda")(hd, key, value, mask.cuda())
        assert got.device.type == "cuda" and got.dtype == dtype
        assert torch.equal(got[mask.cuda()], hd[mask.cuda()])
        ref = gate(h.to(dtype), key, value, mask).float()
        assert torch.allclose(got.float().cpu(), ref, rtol=1e-6 if dtype == torch.float32 else 2 ** -7, atol=1e-6)
    assert torch.allclose(gate.to("cuda")(h.cuda(), key.cuda(), value.cuda(), mask.cuda()).cpu(), cpu, rtol=1e-6, atol=1e-6)
