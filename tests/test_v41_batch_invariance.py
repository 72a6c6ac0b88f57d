"""Batch invariance of the v41 backbone: greedy decode of 1, 4 and 16 sessions in one batch gives
each session the same logits, bit for bit, and so the same tokens, as decoding it alone.

The quantised linears are row-independent by construction (kernels/block_scaled.c); the other
ops of a decode step (norms, attention over each session's own cache, routing, the head) work
row by row. The one known exception is arithmetic, not structural: a single row sums each
32-wide block in MKL's GEMV order (the official CPU bits), more rows in order; the two differ
only where a block sum rounds, which these sessions do not hit. With ENGRAMFLOW_BATCH_INVARIANT=1
one row is summed in order too, and then no input can tell the two apart.
"""
import pytest
import torch

from engramflow.kernels import sum_order
from engramflow.pipeline.engine import Engine
from v41_golden import V41_SMALL

SESSIONS, STEPS = 16, 4


@pytest.fixture(scope="module")
def engine():
    e = Engine(V41_SMALL, backbone="v41")
    yield e
    e.shutdown()


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(3, 20, (SESSIONS,), generator=g).tolist()
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in lengths]


def greedy(engine, prompts, group):
    """Prefill each session of `group` alone, then decode them all in one batch per step."""
    sessions = {i: engine.open() for i in group}
    try:
        tokens = {i: [int(engine.prefill(sessions[i], prompts[i]).argmax())] for i in group}
        logits = {i: [] for i in group}
        for _ in range(STEPS):
            out = engine.decode_step({sessions[i]: tokens[i][-1] for i in group})
            for i in group:
                logits[i].append(out[sessions[i]])
                tokens[i].append(int(out[sessions[i]].argmax()))
    finally:
        for s in sessions.values():
            engine.close(s)
    return tokens, logits


def test_batched_greedy_decode_equals_each_session_alone(engine, prompts):
    assert not sum_order.BATCH_INVARIANT  # the default: one row in the official GEMV order
    alone = [greedy(engine, prompts, [i]) for i in range(SESSIONS)]
    for size in (4, SESSIONS):
        tokens, logits = greedy(engine, prompts, list(range(size)))
        for i in range(size):
            assert tokens[i] == alone[i][0][i], f"session {i} in a batch of {size}"
            for step, (got, want) in enumerate(zip(logits[i], alone[i][1][i])):
                assert torch.equal(got, want), f"session {i}, batch of {size}, step {step}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_ops_give_each_row_its_one_row_bits_when_batch_invariant(monkeypatch, dtype):
    """ENGRAMFLOW_BATCH_INVARIANT=1: the dense linears (HyperMix, MoE gate, compressor, indexer)
    and the grouped wo_a projection give row i of a T-row call exactly the one-row call's bits."""
    from engramflow.model.v41.ops import dense_linear, grouped_projection

    monkeypatch.setattr(sum_order, "BATCH_INVARIANT", True)
    g = torch.Generator().manual_seed(1)
    w = torch.randn(96, 320, generator=g).to(dtype)
    wg = torch.randn(4, 24, 80, generator=g).to(dtype)
    for t in (2, 5, 33):
        x = torch.randn(t, 320, generator=g).to(dtype)
        got = dense_linear(x, w)
        o = torch.randn(t, 4, 80, generator=g).to(dtype)
        got_g = grouped_projection(o, wg)
        for i in range(t):
            assert torch.equal(got[i], torch.nn.functional.linear(x[i:i + 1], w)[0])
            assert torch.equal(got_g[i], grouped_projection(o[i:i + 1], wg)[0])
        ref = x.double() @ w.double().T  # and they are the product, to the dtype's precision
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        assert torch.allclose(got.double(), ref, rtol=tol, atol=tol * ref.abs().max().item())
