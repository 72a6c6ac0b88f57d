"""Backbones: KV-cache decode, stage splits, sessions, and where/how Engram is applied."""
import time

import pytest
import torch

from engramflow.errors import EngramflowError
from engramflow.model.backbone_emulated import EmulatedBackbone
from engramflow.model.backbone_reference import ReferenceBackbone, reference_weights
from engramflow.io.config import from_dict
from engramflow.io.presets import preset


def gate_oracle(h, key, value, q_weight, k_weight, mask=None, eps=1e-6):
    """The gating of docs/v41.md ("Engram"), written out per stream in float64."""
    h, key, value = h.double(), key.double(), value.double()
    w = (q_weight.double() * k_weight.double())[None]
    dim = h.shape[-1]
    rstd = torch.rsqrt(h.pow(2).mean(-1) + eps) * torch.rsqrt(key.pow(2).mean(-1) + eps)
    dot = (h * w * key).sum(-1) * rstd / dim ** 0.5
    gate = torch.sigmoid(torch.copysign(dot.abs().clamp_min(1e-6).sqrt(), dot))
    if mask is not None:
        gate = gate.masked_fill(mask[:, None], 0.0)
    return (h + gate[..., None] * value[:, None, :]).float()


TINY = {
    "vocab_size": 129280, "dim": 64, "n_layers": 16, "hc_mult": 4, "engram_layer_ids": [1, 14],
    "engram_num_embeddings": [2_000_000, 2_000_000], "engram_max_ngram_size": 4, "engram_n_heads": 8,
    "engram_head_dim": 32, "engram_vocab_size": 1000, "engram_pad_token_id": 2,
    "engram_compressed_vocab_size": 99092, "n_heads": 4, "head_dim": 16, "inter_dim": 128, "max_seq_len": 256,
}
HC, DIM = 4, 64


@pytest.fixture(scope="module")
def cfg():
    return from_dict(TINY)


@pytest.fixture(scope="module")
def weights(cfg):
    return reference_weights(cfg, seed=0)


@pytest.fixture
def gen(rng):
    return torch.Generator().manual_seed(int(rng.integers(2**62)))


def stage(cfg, weights, blocks=None, **kw):
    return ReferenceBackbone(cfg, weights.__getitem__, blocks or range(cfg.n_layers), **kw)


def engram_inputs(cfg, n, gen):
    """Random per-position Engram K/V for every Engram layer: {layer: (key, value)}."""
    return {layer: (torch.randn(n, HC, DIM, generator=gen), torch.randn(n, DIM, generator=gen))
            for layer in cfg.engram_layer_ids}


def resolvers(kv, a=0, b=None):
    """Resolvers over positions [a, b) of full-sequence K/V."""
    return {layer: (lambda k=k, v=v: (k[a:b], v[a:b])) for layer, (k, v) in kv.items()}


def prompt(cfg, n, gen):
    return torch.randint(0, cfg.vocab_size, (n,), generator=gen)


def run(backbone, session, ids, kv, start_pos=0, mask=None, a=0, b=None):
    if session not in backbone.cache:
        backbone.open(session)
    return backbone.forward(session, ids, start_pos, resolvers(kv, a, b), mask)


# -- weights -------------------------------------------------------------------------------------


def test_reference_weights_are_deterministic_and_shaped(cfg, weights):
    again = reference_weights(cfg, seed=0)
    other = reference_weights(cfg, seed=1)
    assert weights.keys() == again.keys()
    assert all(torch.equal(weights[k], again[k]) for k in weights)
    assert not torch.equal(weights["layers.3.attn.wq.weight"], other["layers.3.attn.wq.weight"])
    assert all(t.dtype == torch.bfloat16 for t in weights.values())
    assert weights["embed.weight"].shape == (129280, 64)
    assert weights["head.weight"].shape == (129280, 64)
    assert weights["layers.0.attn.wq.weight"].shape == (64, 64)
    assert weights["layers.0.attn.wo.weight"].shape == (64, 64)
    assert weights["layers.0.ffn.w1.weight"].shape == (128, 64)
    assert weights["layers.0.ffn.w2.weight"].shape == (64, 128)
    assert weights["layers.14.engram.q_weight"].shape == (4, 64)
    assert "layers.2.engram.q_weight" not in weights
    assert abs(weights["layers.1.engram.k_weight"].float().mean() - 1) < 0.05


def test_activations_stay_order_one_and_greedy_tokens_vary(cfg, weights, gen):
    bb = stage(cfg, weights)
    finals = set()
    for i in range(8):
        kv = engram_inputs(cfg, 12, gen)
        out = run(bb, f"s{i}", prompt(cfg, 12, gen), kv)
        assert torch.isfinite(out.logits).all()
        assert 0.3 < out.logits.std() < 10
        finals.add(int(out.tokens[-1]))
    assert len(finals) >= 4


# -- KV cache ------------------------------------------------------------------------------------


def test_incremental_decode_matches_full_forward(cfg, weights, gen):
    bb = stage(cfg, weights)
    n, n_prefill = 14, 5
    ids, kv = prompt(cfg, n, gen), engram_inputs(cfg, n, gen)
    mask = torch.rand(n, generator=gen) < 0.3
    # each step's logits against a one-shot forward over the same prefix, at every position
    steps = [run(bb, "inc", ids[:n_prefill], kv, 0, mask[:n_prefill], 0, n_prefill).logits]
    for p in range(n_prefill, n):
        steps.append(run(bb, "inc", ids[p:p + 1], kv, p, mask[p:p + 1], p, p + 1).logits)
    for p, step in zip(range(n_prefill - 1, n), steps):
        full = run(bb, f"full{p}", ids[:p + 1], kv, 0, mask[:p + 1], 0, p + 1).logits
        assert (step - full).abs().max() <= 1e-5, p
    assert bb.cached_len("inc") == n


@pytest.mark.parametrize("cuts", [(1,), (14,), (7,), (1, 14), (5, 12)])
def test_stage_split_matches_one_stage(cfg, weights, gen, cuts):
    n = 9
    ids, kv = prompt(cfg, n, gen), engram_inputs(cfg, n, gen)
    mask = torch.rand(n, generator=gen) < 0.3
    whole = run(stage(cfg, weights), "s", ids, kv, mask=mask)
    edges = [0, *cuts, cfg.n_layers]
    x, waits = ids, {}
    for a, b in zip(edges, edges[1:]):
        out = run(stage(cfg, weights, range(a, b)), "s", x, kv, mask=mask)
        waits |= out.exposed_wait_ms
        x = out.h if out.logits is None else out.logits
    assert (x - whole.logits).abs().max() <= 1e-6
    assert sorted(waits) == [1, 14]


def test_fork_is_isolated(cfg, weights, gen):
    bb = stage(cfg, weights)
    n = 10
    ids_a, ids_b = prompt(cfg, n, gen), prompt(cfg, n, gen)
    ids_b[:6] = ids_a[:6]
    kv = engram_inputs(cfg, n, gen)
    run(bb, "a", ids_a[:6], kv, 0, None, 0, 6)
    bb.fork("a", "b")
    out_a = run(bb, "a", ids_a[6:], kv, 6, None, 6, n).logits
    out_b = run(bb, "b", ids_b[6:], kv, 6, None, 6, n).logits
    fresh_a = run(bb, "fa", ids_a, kv).logits  # the last position, like out_a
    fresh_b = run(bb, "fb", ids_b, kv).logits
    assert (out_a - fresh_a).abs().max() <= 1e-5
    assert (out_b - fresh_b).abs().max() <= 1e-5
    with pytest.raises(EngramflowError, match="'b'"):
        bb.fork("a", "b")
    with pytest.raises(EngramflowError, match="'nope'"):
        bb.fork("nope", "c")


def test_rollback_via_start_pos_equals_fresh_run(cfg, weights, gen):
    bb = stage(cfg, weights)
    ids, kv = prompt(cfg, 10, gen), engram_inputs(cfg, 10, gen)
    run(bb, "s", ids, kv)
    new_ids, new_kv = prompt(cfg, 4, gen), engram_inputs(cfg, 4, gen)
    both = {layer: (torch.cat([kv[layer][0][:6], new_kv[layer][0]]), torch.cat([kv[layer][1][:6], new_kv[layer][1]]))
            for layer in kv}
    rolled = run(bb, "s", new_ids, both, start_pos=6, a=6, b=10).logits
    fresh = run(bb, "f", torch.cat([ids[:6], new_ids]), both).logits
    assert (rolled - fresh).abs().max() <= 1e-5
    assert bb.cached_len("s") == 10
    bb.truncate("s", 3)
    assert bb.cached_len("s") == 3


def test_bad_input_names_the_value_and_leaves_state(cfg, weights, gen):
    bb = stage(cfg, weights)
    kv = engram_inputs(cfg, 4, gen)
    run(bb, "s", prompt(cfg, 4, gen), kv)
    with pytest.raises(EngramflowError, match="'ghost'"):
        bb.forward("ghost", prompt(cfg, 1, gen), 0, resolvers(kv, 0, 1), None)
    with pytest.raises(EngramflowError, match="start_pos=7"):
        bb.forward("s", prompt(cfg, 1, gen), 7, resolvers(kv, 0, 1), None)
    with pytest.raises(EngramflowError, match="129280"):
        bb.forward("s", torch.tensor([129280]), 2, resolvers(kv, 0, 1), None)
    with pytest.raises(EngramflowError, match=r"layer\(s\) \[14\]"):
        bb.forward("s", prompt(cfg, 1, gen), 2, {1: resolvers(kv, 0, 1)[1]}, None)
    with pytest.raises(EngramflowError, match="engram_mask"):
        bb.forward("s", prompt(cfg, 2, gen), 2, resolvers(kv, 0, 2), torch.zeros(3, dtype=torch.bool))
    with pytest.raises(EngramflowError, match="max_seq_len=256"):
        bb.forward("s", prompt(cfg, 255, gen), 2, resolvers(kv, 0, 1), None)
    assert bb.cached_len("s") == 4  # every rejected call left the session as it was
    with pytest.raises(EngramflowError, match="already open"):
        bb.open("s")
    with pytest.raises(EngramflowError, match="length 9"):
        bb.truncate("s", 9)
    with pytest.raises(EngramflowError, match="blocks"):
        stage(cfg, weights, range(3, 20))
    with pytest.raises(EngramflowError, match="block_ms must be a number >= 0, got -1"):
        EmulatedBackbone(cfg, None, range(4), -1)


def test_closing_sessions_returns_counts_to_zero(cfg, weights, gen):
    bb = stage(cfg, weights)
    kv = engram_inputs(cfg, 5, gen)
    for s in ("a", "b", "c"):
        run(bb, s, prompt(cfg, 5, gen), kv)
    bb.fork("a", "d")
    bb.reset("b")
    assert bb.live_sessions() == 4 and bb.cached_positions() == 15
    for s in ("a", "b", "c", "d"):
        bb.close(s)
    assert bb.live_sessions() == 0 and bb.cached_positions() == 0
    with pytest.raises(EngramflowError, match="'a'"):
        bb.close("a")


# -- Engram placement and math -------------------------------------------------------------------


def test_resolver_called_once_at_its_block_entry(cfg, weights, gen):
    bb = stage(cfg, weights)
    n = 6
    kv = engram_inputs(cfg, n, gen)
    calls = {}

    def resolver(layer):
        def get():
            calls.setdefault(layer, []).append(time.time_ns())
            time.sleep(0.002)
            return kv[layer]
        return get

    bb.open("s")
    out = bb.forward("s", prompt(cfg, n, gen), 0, {layer: resolver(layer) for layer in kv}, None)
    spans = {s.block: s for s in out.spans}
    assert [s.block for s in out.spans] == list(range(16))
    for layer in (1, 14):
        (t,) = calls[layer]
        assert spans[layer - 1].end_ns <= t and spans[layer].start_ns <= t <= spans[layer].end_ns
        assert spans[layer].wait_ms == pytest.approx(out.exposed_wait_ms[layer])
        assert out.exposed_wait_ms[layer] >= 2.0
    assert calls.keys() == {1, 14}


def test_gate_applied_at_block_entry_before_attention(cfg, weights, gen):
    """Block 14 alone: gating inside the stage == gating by the §2 oracle, then the block
    with a zero Engram value (which makes the stage's own gate a no-op)."""
    n = 7
    h = 1.5 * torch.randn(n, HC, DIM, generator=gen)
    key, value = torch.randn(n, HC, DIM, generator=gen), torch.randn(n, DIM, generator=gen)
    mask = torch.rand(n, generator=gen) < 0.4
    bb = stage(cfg, weights, range(14, 15))
    got = run(bb, "a", h, {14: (key, value)}, mask=mask).h
    pre = gate_oracle(h, key, value, weights["layers.14.engram.q_weight"], weights["layers.14.engram.k_weight"],
                      mask, cfg.norm_eps)
    want = run(bb, "b", pre, {14: (key, torch.zeros_like(value))}).h
    assert (got - want).abs().max() <= 1e-5
    # and it did something: without gating the block's output differs
    assert (got - run(bb, "c", h, {14: (key, torch.zeros_like(value))}).h).abs().max() > 1e-2


def test_masked_positions_untouched_by_gate(cfg, weights, gen):
    n = 8
    h = torch.randn(n, HC, DIM, generator=gen)
    key, value = torch.randn(n, HC, DIM, generator=gen), torch.randn(n, DIM, generator=gen)
    mask = torch.zeros(n, dtype=torch.bool)
    mask[torch.randperm(n, generator=gen)[:3]] = True
    bb = stage(cfg, weights, range(1, 2))
    masked = run(bb, "a", h, {1: (key, value)}, mask=mask).h
    zeroed = run(bb, "b", h, {1: (key, value.masked_fill(mask[:, None], 0.0))}).h
    assert (masked - zeroed).abs().max() <= 1e-6


# -- emulated ------------------------------------------------------------------------------------


def test_emulated_sleeps_per_block_and_resolves_at_layer(cfg, gen):
    block_ms, n = 5.0, 3
    bb = EmulatedBackbone(cfg, None, range(16), block_ms)
    kv = engram_inputs(cfg, n, gen)
    called = {}

    def resolver(layer, delay, n_pos=n):
        def get():
            called[layer] = time.perf_counter()
            time.sleep(delay)
            return kv[layer][0][:n_pos], kv[layer][1][:n_pos]
        return get

    bb.open("s")
    t0 = time.perf_counter()
    out = bb.forward("s", prompt(cfg, n, gen), 0, {1: resolver(1, 0.0), 14: resolver(14, 0.0)}, None)
    wall = (time.perf_counter() - t0) * 1e3
    # lower bounds only: sleeps guarantee them; upper bounds depend on the machine's load (the
    # overshoot-only cost of a late K/V is measured by benchmarks/bench_overlap.py)
    assert 16 * block_ms <= wall
    assert (called[14] - t0) * 1e3 >= 14 * block_ms - 0.5
    assert block_ms - 0.5 <= (called[1] - t0) * 1e3 < (called[14] - t0) * 1e3
    assert out.tokens.shape == (1,) and out.logits.shape == (1, 256)
    assert int(out.tokens.min()) >= 0 and int(out.tokens.max()) < cfg.vocab_size

    # a late layer-1 K/V delays the blocks after it: 30 ms at block 1 on top of the 80 ms
    t0 = time.perf_counter()
    out = bb.forward("s", prompt(cfg, 1, gen), n, {1: resolver(1, 0.030, 1), 14: resolver(14, 0.0, 1)}, None)
    wall = (time.perf_counter() - t0) * 1e3
    assert 15 * block_ms + 30 <= wall
    assert out.exposed_wait_ms[1] >= 30
    assert bb.cached_len("s") == n + 1
    bb.close("s")
    assert bb.live_sessions() == 0 and bb.cached_positions() == 0


def test_emulated_gating_is_real_and_stages_compose(cfg, weights, gen):
    n = 5
    ids, kv = prompt(cfg, n, gen), engram_inputs(cfg, n, gen)
    one = EmulatedBackbone(cfg, weights, range(16), 0.0)
    whole = run(one, "s", ids, kv)
    x = ids
    for a, b in [(0, 9), (9, 16)]:
        out = run(EmulatedBackbone(cfg, weights.__getitem__, range(a, b), 0.0), "s", x, kv)
        x = out.h if out.h is not None else out.tokens
    assert torch.equal(x, whole.tokens)
    # the continuation depends on the Engram values
    other = {layer: (k, torch.randn(v.shape, generator=gen)) for layer, (k, v) in kv.items()}
    assert (run(one, "t", ids, other).logits - whole.logits).abs().max() > 1e-3
    # the gate at layer 1 is the §2 gate on the emulated embedding
    first = EmulatedBackbone(cfg, weights, range(0, 2), 0.0)
    h0 = run(EmulatedBackbone(cfg, weights, range(0, 1), 0.0), "s", ids, kv).h
    want = gate_oracle(h0, *kv[1], weights["layers.1.engram.q_weight"], weights["layers.1.engram.k_weight"],
                       None, cfg.norm_eps)
    assert (run(first, "s", ids, kv).h - want).abs().max() <= 1e-5


def test_emulated_handles_real_v41_sizes(gen):
    cfg = preset("deepseek-v4.1-flash")
    n = 3
    kv = {layer: (torch.randn(n, 4, 5120, generator=gen), torch.randn(n, 5120, generator=gen))
          for layer in cfg.engram_layer_ids}
    bb = EmulatedBackbone(cfg, None, range(40), 0.0)
    out = run(bb, "s", torch.randint(0, cfg.vocab_size, (n,), generator=gen), kv)
    assert out.tokens.shape == (1,) and int(out.tokens.max()) < cfg.vocab_size
    mid = EmulatedBackbone(cfg, None, range(10, 20), 0.0)
    h = torch.randn(n, 4, 5120, generator=gen)
    assert run(mid, "s", h, kv).h.shape == (n, 4, 5120)


# -- device --------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_reference_on_cuda_matches_cpu(cfg, weights, gen):
    n = 9
    ids, kv = prompt(cfg, n, gen), engram_inputs(cfg, n, gen)
    cpu = run(stage(cfg, weights), "s", ids, kv).logits
    gpu_bb = stage(cfg, weights, device="cuda")
    prefill = run(gpu_bb, "s", ids[:5], kv, 0, None, 0, 5).logits
    decode = [run(gpu_bb, "s", ids[p:p + 1], kv, p, None, p, p + 1).logits for p in range(5, n)]
    gpu = torch.cat([prefill, *decode])
    assert gpu.device.type == "cuda" and gpu_bb.cache.layer("s", 0)[0].device.type == "cuda"
    assert (gpu.cpu() - cpu).abs().max() <= 1e-3
    em = EmulatedBackbone(cfg, weights, range(16), 0.0, device="cuda")
    assert run(em, "s", ids, kv).tokens.device.type == "cuda"


def test_failed_resolver_leaves_session_at_start_pos(cfg, weights, gen):
    bb = stage(cfg, weights)
    kv = engram_inputs(cfg, 6, gen)
    run(bb, "s", prompt(cfg, 6, gen), kv)

    def broken():
        raise RuntimeError("projection actor died")

    with pytest.raises(RuntimeError, match="died"):
        bb.forward("s", prompt(cfg, 2, gen), 4, {1: broken, 14: resolvers(kv, 4, 6)[14]}, None)
    assert bb.cached_len("s") == 4
    with pytest.raises(EngramflowError, match=r"Engram layer 1: expected key \[2, 4, 64\]"):
        bb.forward("s", prompt(cfg, 2, gen), 4, resolvers(kv, 0, 3), None)


def test_reference_reads_a_synthetic_checkpoint(tiny_ckpt, gen):
    from engramflow.io.checkpoint import Checkpoint

    ck = Checkpoint(tiny_ckpt)
    cfg = ck.config
    n = 5
    ids, kv = prompt(cfg, n, gen), engram_inputs(cfg, n, gen)
    from_ckpt = run(ReferenceBackbone(cfg, ck.tensor, range(cfg.n_layers)), "s", ids, kv).logits
    direct = run(stage(cfg, reference_weights(cfg, seed=0)), "s", ids, kv).logits
    assert torch.equal(from_ckpt, direct)
