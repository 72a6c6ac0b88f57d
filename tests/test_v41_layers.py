"""Each V4.1 layer piece alone, against a float64 or scalar reference on fresh random inputs.

Tolerances follow the precision of what is compared: exact where the arithmetic is exact
(power-of-two scales, E2M1/E4M3 rounding, index selection), ~1e-2 relative where a result is
rounded to bf16 once, and the FP8 quantisation step (2^-4 relative) where activations are
quantised on purpose.
"""
import math

import numpy as np
import pytest
import torch

from engramflow.kernels.formats import E2M1_VALUES
from engramflow.kernels.quant import (QuantWeight, e2m1_round, fp4_qdq, fp8_act_quant, fp8_qdq,
                                      pow2_ceil_scale, quant_linear)
from engramflow.model.backbone_base import Segment
from engramflow.model.v41.attention import window_list
from engramflow.model.v41.hc import HyperMix, collapse, expand
from engramflow.model.v41.indexer import select_candidate_blocks
from engramflow.model.v41.rope import Rotary, inverse_frequencies
from engramflow.model.v41.sparse_attention import sparse_attention


@pytest.fixture
def gen(rng):
    return torch.Generator().manual_seed(int(rng.integers(2**31)))


def test_pow2_scale_is_the_smallest_power_of_two_at_or_above(gen):
    amax = torch.rand(10000, generator=gen) * 10.0 ** torch.randint(-8, 8, (10000,), generator=gen)
    inv = torch.tensor(1 / 448, dtype=torch.float32)
    got = pow2_ceil_scale(amax, inv).double()
    prod = (amax * inv).double()
    assert torch.all(got >= prod) and torch.all(got / 2 < prod)
    assert torch.all(torch.log2(got) == torch.round(torch.log2(got)))


def test_e2m1_rounding_matches_a_scalar_nearest_even(gen):
    grid = E2M1_VALUES[:8].tolist()
    v = torch.cat([torch.rand(4000, generator=gen) * 12 - 6, torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]),
                   -torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])])

    def scalar(x: float) -> float:
        mag = abs(x)
        dist = [abs(mag - g) for g in grid]
        best = min(dist)
        codes = [i for i, d in enumerate(dist) if d == best]
        code = codes[0] if len(codes) == 1 else next(c for c in codes if c % 2 == 0)
        return math.copysign(grid[code], x)

    assert e2m1_round(v).tolist() == [scalar(x) for x in v.tolist()]


def test_fp8_activation_quantisation(gen):
    x = (torch.randn(64, 256, generator=gen) * torch.rand(64, 1, generator=gen) * 100).bfloat16()
    q, s = fp8_act_quant(x)
    assert torch.all(q.abs() <= 448)
    assert torch.equal(q, q.to(torch.float8_e4m3fn).float())  # values on the E4M3 grid
    back = fp8_qdq(x).double()
    xd = x.double()
    big = xd.abs() > s.repeat_interleave(32, dim=1).double() * 2.0 ** -6  # E4M3 normal range
    assert torch.all(((back - xd).abs() <= xd.abs() * 2.0 ** -4)[big])


@pytest.mark.parametrize("group,e4m3", [(16, True), (32, False)])
def test_fp4_qdq_error_within_half_a_grid_step(gen, group, e4m3):
    x = (torch.randn(32, 128, generator=gen) * 3).bfloat16()
    y = fp4_qdq(x, group, e4m3).double()
    g = x.double().unflatten(-1, (-1, group))
    amax = g.abs().amax(-1, keepdim=True)
    # half the widest grid step (1) times the scale bounds the error; the scale is amax/6 rounded
    # to E4M3 (up to 1/16 above) or the next power of two (up to 2x above)
    scale = amax / 6 * (1.0625 if e4m3 else 2.0)
    assert torch.all((y.unflatten(-1, (-1, group)) - g).abs() <= scale + 1e-6)


def test_quant_linear_is_the_dequantised_product(gen):
    codes = (torch.randn(96, 160, generator=gen) * 50).clamp(-448, 448).to(torch.float8_e4m3fn)
    tiles = torch.randint(110, 130, (3, 5), generator=gen).to(torch.uint8)
    w = QuantWeight.fp8(codes, tiles)
    x = torch.randn(7, 160, generator=gen).bfloat16()
    got = quant_linear(x, w).double()
    want = fp8_qdq(x).double() @ w.dequantized().double().T
    assert torch.allclose(got, want, rtol=2 ** -7, atol=1e-6 * float(want.abs().max()))
    # one row alone gives the same bits as inside a batch (what makes decode match prefill)
    assert torch.equal(quant_linear(x[3:4], w), quant_linear(x, w)[3:4])


def test_fp4_weights_unpack_low_nibble_first(gen):
    codes = torch.randint(0, 16, (8, 64), generator=gen).to(torch.uint8)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).view(torch.int8)
    scales = torch.full((8, 2), 127, dtype=torch.uint8)
    w = QuantWeight.fp4(packed, scales)
    assert torch.equal(w.values.float(), E2M1_VALUES[codes.long()])


def test_sparse_attention_matches_float64_softmax_with_sink(gen):
    t, h, d, n = 5, 4, 64, 150
    q = torch.randn(t, h, d, generator=gen).bfloat16()
    kv = torch.randn(n, d, generator=gen).bfloat16()
    sink = torch.randn(h, generator=gen)
    idx = torch.stack([torch.randperm(n, generator=gen)[:100] for _ in range(t)])
    idx[1, 30:] = -1
    idx[2, :] = -1  # nothing valid: zeros
    got = sparse_attention(q, kv, sink, idx, d ** -0.5).double()
    for i in range(t):
        valid = idx[i][idx[i] >= 0]
        if valid.numel() == 0:
            assert torch.all(got[i] == 0)
            continue
        rows = kv[valid].double()
        logits = q[i].double() @ rows.T * d ** -0.5  # [h, k]
        m = torch.maximum(logits.amax(-1), sink.double())
        p = torch.exp(logits - m[:, None])
        want = (p @ rows) / (p.sum(-1) + torch.exp(sink.double() - m))[:, None]
        assert torch.allclose(got[i], want, rtol=2e-2, atol=2e-2 * float(want.abs().max()))


def test_window_list_is_the_prefill_layout():
    pos = torch.arange(10, 14)
    lists = window_list(pos, 14, 8)
    assert lists.tolist()[0] == [3, 4, 5, 6, 7, 8, 9, 10]
    assert window_list(torch.arange(0, 3), 3, 8).tolist() == [[0, -1, -1], [0, 1, -1], [0, 1, 2]]
    # a decode step lists what the last query of a one-shot prefill lists
    assert window_list(torch.tensor([13]), 14, 8).tolist() == window_list(torch.arange(14), 14, 8)[-1:].tolist()


def test_sinkhorn_mix_against_float64(gen):
    hc, dim, eps = 4, 64, 1e-6
    fn, base, scale = torch.randn(24, hc * dim, generator=gen) * 0.1, torch.randn(24, generator=gen), torch.rand(3, generator=gen)
    x = torch.randn(9, hc, dim, generator=gen).bfloat16()
    pre, post, comb = HyperMix(fn, base, scale, hc, 20, eps, 1e-20)(x)
    flat = x.flatten(-2).double()
    m = flat @ fn.double().T / torch.sqrt(flat.square().mean(-1, keepdim=True))
    s, b = scale.double(), base.double()
    c = torch.softmax((m[:, 8:] * s[2] + b[8:]).view(9, 4, 4), dim=-1) + eps
    c = c / (c.sum(-2, keepdim=True) + eps)
    for _ in range(19):
        c = c / (c.sum(-1, keepdim=True) + eps)
        c = c / (c.sum(-2, keepdim=True) + eps)
    assert torch.allclose(comb.double(), c, atol=1e-5)
    assert torch.allclose(pre.double(), torch.sigmoid(m[:, :4] * s[0] + b[:4]) + eps, atol=1e-5)
    assert torch.allclose(post.double(), 2 * torch.sigmoid(m[:, 4:8] * s[1] + b[4:8]), atol=1e-5)
    assert torch.allclose(comb.sum(-2), torch.ones(9, hc), atol=1e-5)  # the last step normalises columns


def test_collapse_and_expand_against_float64(gen):
    x = torch.randn(6, 4, 32, generator=gen).bfloat16()
    f = torch.randn(6, 32, generator=gen).bfloat16()
    pre, post, comb = torch.rand(6, 4, generator=gen), torch.rand(6, 4, generator=gen), torch.rand(6, 4, 4, generator=gen)
    want = torch.einsum("tc,tcd->td", pre.double(), x.double())
    assert torch.allclose(collapse(x, pre).double(), want, rtol=1e-2, atol=1e-2)
    want = post.double()[..., None] * f.double()[:, None] + torch.einsum("tab,tad->tbd", comb.double(), x.double())
    assert torch.allclose(expand(f, x, post, comb).double(), want, rtol=1e-2, atol=1e-2)


def test_yarn_ramp_of_the_released_config():
    base = inverse_frequencies(64, 160000.0)
    yarn = inverse_frequencies(64, 160000.0, 65536, 16, 32, 1)
    assert torch.equal(yarn[:16], base[:16])  # low = 15: the ramp starts after dim 15
    assert torch.allclose(yarn[25:], base[25:] / 16)  # high = 25
    assert torch.all((yarn[16:25] < base[16:25]) & (yarn[16:25] > base[16:25] / 16))


def test_rotation_matches_float64_and_inverts(gen):
    rot = Rotary(16, inverse_frequencies(16, 10000.0))
    x = torch.randn(7, 3, 48, generator=gen).bfloat16()
    pos = torch.randint(0, 5000, (7,), generator=gen)
    y = rot.rotate(x, pos)
    assert torch.equal(y[..., :32], x[..., :32])  # only the tail rotates
    ang = pos.double()[:, None] * rot.inv_freq.double()[None]  # [7, 8]
    xr = x[..., 32:].double().unflatten(-1, (-1, 2))
    c, s = torch.cos(ang)[:, None], torch.sin(ang)[:, None]
    want = torch.stack([xr[..., 0] * c - xr[..., 1] * s, xr[..., 0] * s + xr[..., 1] * c], -1).flatten(-2)
    assert torch.allclose(y[..., 32:].double(), want, atol=3e-2)
    assert torch.allclose(rot.rotate(y, pos, inverse=True).float(), x.float(), atol=3e-2)


def test_candidate_blocks_against_a_loop(rng):
    t, n, block, keep = 6, 37, 4, 3
    scores = torch.from_numpy(rng.standard_normal((t, n))).bfloat16()
    visible = torch.tensor([[1], [5], [12], [20], [37], [36]])
    scores = scores.masked_fill(torch.arange(n) >= visible, -torch.inf)
    got = select_candidate_blocks(scores, visible, keep, block)
    for i in range(t):
        v = int(visible[i])
        n_blocks = -(-v // block)
        best = [float(scores[i, b * block:(b + 1) * block].float().max()) for b in range(n_blocks)]
        best[(v - 1) // block] = math.inf
        ranked = sorted(best, reverse=True)
        if len(ranked) > keep and ranked[keep - 1] == ranked[keep]:
            continue  # a tie at the cut (bf16 scores): either block is right
        kept = set(np.argsort(best, kind="stable")[::-1][:keep].tolist())
        want = [j < v and j // block in kept for j in range(n)]
        assert got[i].tolist()[:v] == want[:v], i


def test_moe_routing_against_float64(gen):
    import dataclasses

    from engramflow.model.v41.moe import MoE, MoEWeights

    cfg = type("Cfg", (), dict(gate_temp=1.0, score_func="sqrtsoftplus", n_activated_experts=3, norm_topk_prob=True,
                               route_scale=1.5))
    gate, bias = torch.randn(16, 64, generator=gen) * 0.2, torch.randn(16, generator=gen) * 0.1
    moe = MoE(cfg, MoEWeights(gate, bias, [], None))
    x = torch.randn(40, 64, generator=gen).bfloat16()
    weights, chosen = moe.route(x)
    scores = torch.sqrt(torch.nn.functional.softplus(x.double() @ gate.double().T))
    biased = scores + bias.double()
    for i in range(40):
        order = biased[i].argsort(descending=True)
        if float(biased[i, order[2]] - biased[i, order[3]]) < 1e-5:
            continue  # a near-tie may go either way in fp32
        assert set(chosen[i].tolist()) == set(order[:3].tolist())
        w = scores[i, chosen[i]]
        assert torch.allclose(weights[i].double(), w / w.sum() * 1.5, rtol=1e-5)
    assert not dataclasses.is_dataclass(cfg)  # (a stand-in config: only the keys routing reads)


def test_ratio2_compressor_pools_like_float64(gen):
    from engramflow.model.v41.compressor import Compressor, CompressorWeights

    dim, hd = 64, 32
    w = CompressorWeights(torch.randn(hd, dim, generator=gen) * 0.2, torch.randn(hd, dim, generator=gen) * 0.2,
                          torch.ones(hd).bfloat16())
    comp = Compressor(0, 2, w, Rotary(16, inverse_frequencies(16, 1e4)), 1e-20)
    bufs = {"carry_kv.0": torch.zeros(8, hd), "carry_score.0": torch.zeros(8, hd)}
    x = torch.randn(7, dim, generator=gen).bfloat16()
    def one(start, n):  # a forward of one session's n rows at start
        return [Segment("s", 0, n, start, extra={"buffers": bufs.__getitem__})]
    ((g0, lat),) = comp.latents(x[:3], one(0, 3))  # group 0 done, token 2 waits in the carry
    ((g1, lat2),) = comp.latents(x[3:], one(3, 4))  # token 3 completes group 1 with the carry
    assert (g0, lat.shape[0], g1, lat2.shape[0]) == (0, 1, 1, 2)
    xd = x.double()
    kv, sc = xd @ w.wkv.double().T, xd @ w.wgate.double().T
    for j, row in ((0, lat[0]), (1, lat2[0]), (2, lat2[1])):
        p = torch.softmax(sc[2 * j:2 * j + 2], dim=0)
        pooled = (p * kv[2 * j:2 * j + 2]).sum(0)
        want = pooled / torch.sqrt(pooled.square().mean())
        assert torch.allclose(row.double(), want, rtol=2e-2, atol=2e-2), j
