"""Batch invariance of the v41 backbone's ops: greedy decode of 1, 4 and 16 sessions in one
batch gives each session the same logits, bit for bit, as decoding it alone (the default batched
numerics: one forward per step); the row-invariant dense kernel (kernels/dense_rows.py) gives
row i of a T-row call exactly the one-row call's bits, equals the float64 product to fp32/bf16
precision on fresh random inputs, and its AVX-512 and portable paths agree bit for bit.
tests/test_batched_forward.py covers whole steps (prefill chunks, images, pipelines, DSpark).
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
    assert engine.stage.numerics == "batched"  # the default
    alone = [greedy(engine, prompts, [i]) for i in range(SESSIONS)]
    for size in (4, SESSIONS):
        tokens, logits = greedy(engine, prompts, list(range(size)))
        for i in range(size):
            assert tokens[i] == alone[i][0][i], f"session {i} in a batch of {size}"
            for step, (got, want) in enumerate(zip(logits[i], alone[i][1][i])):
                assert torch.equal(got, want), f"session {i}, batch of {size}, step {step}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_ops_give_each_row_its_one_row_bits(dtype):
    """Batched numerics: the dense linears (HyperMix, MoE gate, compressor, indexer) and the
    grouped wo_a projection give row i of a T-row call exactly the one-row call's bits, and
    they are the product to the dtype's precision."""
    from engramflow.model.v41.ops import dense_linear, grouped_projection

    g = torch.Generator().manual_seed(torch.seed() % 2**31)  # fresh inputs each run
    w = torch.randn(96, 320, generator=g).to(dtype)
    wg = torch.randn(4, 24, 80, generator=g).to(dtype)
    with sum_order.use("batched"):
        for t in (2, 5, 33, 70):
            x = torch.randn(t, 320, generator=g).to(dtype)
            got = dense_linear(x, w)
            o = torch.randn(t, 4, 80, generator=g).to(dtype)
            got_g = grouped_projection(o, wg)
            for i in range(t):
                assert torch.equal(got[i], dense_linear(x[i:i + 1], w)[0])
                assert torch.equal(got_g[i], grouped_projection(o[i:i + 1], wg)[0])
            ref = x.double() @ w.double().T
            tol = 1e-6 if dtype == torch.float32 else 1e-2
            assert torch.allclose(got.double(), ref, rtol=tol, atol=tol * ref.abs().max().item())


@pytest.mark.parametrize("m,k,n", [(1, 5, 3), (7, 100, 33), (33, 512, 24), (130, 128, 70), (4, 20_480, 24)])
def test_dense_kernel_is_the_float64_product_and_paths_agree(m, k, n):
    from engramflow.kernels import block_scaled_lib
    from engramflow.kernels.dense_rows import dense_rows

    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    for xd, wd in ((torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16)):
        x, w = torch.randn(m, k, generator=g).to(xd), torch.randn(n, k, generator=g).to(wd)
        got = dense_rows(x, w)
        ref = x.double() @ w.double().T
        scale = (x.double().abs() @ w.double().abs().T).max().item()  # the size of the sum's terms
        assert float((got.double() - ref).abs().max()) <= 1e-6 * scale, (xd, wd)
        block_scaled_lib.set_path("portable")
        try:
            assert torch.equal(dense_rows(x, w), got)
        finally:
            block_scaled_lib.set_path("auto")


@pytest.mark.parametrize("name", ["exp", "sigmoid", "silu", "softplus", "polar_unit"])
def test_transcendental_ops_give_an_element_the_same_bits_in_any_size_of_tensor(name):
    """torch computes the tail of a tensor (and each thread's chunk end) with scalar code that can
    differ from its vector code by an ulp; kernels/rowwise.py puts every element on the vector
    path, so a value's bits do not depend on how many values share the call."""
    from engramflow.kernels import rowwise

    fn = getattr(rowwise, name)
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    x = torch.randn(70_000, generator=g) * 8
    with sum_order.use("batched"):
        full = fn(x)
        for n in (1, 3, 17, 33, 100, 40_000):
            at = int(torch.randint(0, x.numel() - n, (1,), generator=g))
            assert torch.equal(fn(x[at:at + n]), full[at:at + n]), n
    want = {"exp": torch.exp, "sigmoid": torch.sigmoid, "silu": torch.nn.functional.silu,
            "softplus": torch.nn.functional.softplus, "polar_unit": lambda a: torch.polar(torch.ones_like(a), a)}[name]
    assert torch.allclose(full, want(x), rtol=1e-6, atol=1e-30)
