"""Speculative decoding with the DSpark draft layers on the Engine (small official model).

* greedy: speculative output equals plain greedy decoding token for token over 200 tokens, with
  drafts that are right, partly right and wrong (an injected drafter that knows the plain
  continuation and spoils some drafts on a fixed pattern), and with the real draft layers; the
  block verified in one batched forward (the default numerics) or, in official numerics, row by
  row (`:exact`);
* rollback: after a rejected draft, the history, every cache row, and the next logits equal a
  session that never drafted;
* sampling: the acceptance rule keeps the target distribution (chi-square on many draws).
"""
import numpy as np
import pytest
import torch

from engramflow.kernels import sum_order
from engramflow.model.sampling import Sampling
from engramflow.model.speculative import accept_greedy, accept_sampled
from engramflow.pipeline.engine import Engine
from engramflow.pipeline.runner import Runner
from engramflow.model.speculative import Draft
from engramflow.scheduling.speculation import ConfidenceGate, verify
from speculative_cases import PROMPT, KnownDrafts, injected_draft, long_ckpt, plain_tokens  # noqa: F401 (fixtures)
from v41_golden import V41_SMALL

N_TOKENS = 200


class InjectedDrafts(Engine):
    """The plain continuation as drafts, some spoiled (speculative_cases.injected_draft)."""
    reference: list[int] = []

    drafts = Runner.drafts  # one session at a time, through _draft below

    def _draft(self, session, token, start, n, sampling, stream, step):
        return injected_draft(self.reference, start, n)


def injected_run(ckpt, speculative: str, reference: list[int], numerics: str | None = None):
    """(tokens, stats) of a speculative greedy run whose drafts are `reference`, some spoiled."""
    e = InjectedDrafts(ckpt, speculative=speculative, numerics=numerics)
    e.reference = reference
    try:
        return e.generate([PROMPT], max_new_tokens=N_TOKENS)[0].tokens, e.speculative_stats
    finally:
        e.shutdown()


def test_greedy_equals_plain_over_200_tokens_with_accepts_and_rejects(long_ckpt, plain_tokens):
    """Batched numerics (the default): every op gives a verified row the bits it has alone, so a
    block verified in one forward is plain greedy's output, token for token."""
    assert sum_order.default_numerics() == "batched"
    got, stats = injected_run(long_ckpt, "dspark", plain_tokens)
    assert got == plain_tokens
    assert 0 < stats.accepted < stats.drafted  # both kinds of step happened, many times
    assert stats.steps < N_TOKENS - 50


def test_official_numerics_exact_rows_equal_plain(long_ckpt):
    """Official numerics: a block's rows run as decode steps with `:exact` (row by row), which is
    plain greedy's output token for token there too (without it the GEMM over the block's rows
    first differs after about 15 tokens)."""
    plain = Engine(long_ckpt, numerics="official")
    want = plain.generate([PROMPT], max_new_tokens=N_TOKENS)[0].tokens
    plain.shutdown()
    got, stats = injected_run(long_ckpt, "dspark:exact", want, numerics="official")
    assert got == want
    assert 0 < stats.accepted < stats.drafted and stats.steps < N_TOKENS - 50


def test_real_draft_layers_greedy_equals_plain(long_ckpt, plain_tokens):
    e = Engine(long_ckpt, speculative="dspark:exact")
    got = e.generate([PROMPT], max_new_tokens=60)[0].tokens
    stats = e.speculative_stats
    e.shutdown()
    assert got == plain_tokens[:60]
    assert stats.drafted > 0 and stats.emitted == 59  # the first token comes from the prefill
    print("real draft layers:", stats.as_dict())


def test_adaptive_greedy_equals_plain_and_gates_unconfident_drafts(long_ckpt, plain_tokens):
    """The gate changes which steps draft (the cost), never the tokens: 200 tokens equal plain
    greedy, with drafts right and wrong, confident and not."""
    hard = lambda j, i: (j // 12) % 2 == 1  # noqa: E731 (stretches of 12 tokens: every draft right, then wrong)
    e = KnownDrafts(long_ckpt, speculative="dspark:exact:adaptive=0.5", spoil=hard)
    e.plant(PROMPT, plain_tokens)
    got = e.generate([PROMPT], max_new_tokens=N_TOKENS)[0].tokens
    gated = e.speculative_stats
    e.shutdown()
    assert got == plain_tokens
    assert gated.gated > 10 and gated.draft_steps > 10 and 0 < gated.accepted < gated.drafted
    assert gated.draft_steps + gated.gated == gated.steps - 1  # the last step cannot draft: one token left


def test_adaptive_real_draft_layers_equal_plain(long_ckpt, plain_tokens):
    e = Engine(long_ckpt, speculative="dspark:exact:adaptive=0.9")
    got = e.generate([PROMPT], max_new_tokens=40)[0].tokens
    stats = e.speculative_stats
    e.shutdown()
    assert got == plain_tokens[:40] and stats.draft_steps > 0


def test_confidence_gate_backs_off_while_unconfident_and_reopens_on_a_confident_draft():
    gate = ConfidenceGate(0.5)

    def draft(logit):
        return Draft([1], torch.zeros(1, 4), torch.tensor([logit]))

    waits = []
    for _ in range(5):  # unconfident drafts: wait 1, 2, 4, 8, 8 steps before drafting again
        gate.observe(draft(-1.0))
        skipped = 0
        while not gate.allows():
            skipped += 1
        waits.append(skipped)
    assert waits == [1, 2, 4, 8, 8]
    gate.observe(draft(0.1))  # sigmoid(0.1) > 0.5: confident
    assert gate.allows() and gate.allows()
    gate.observe(draft(-0.1))
    assert not gate.allows() and gate.allows()  # the backoff started over
    gate.observe(None)  # a step that drafted nothing says nothing
    assert gate.allows()


def _cache_rows(engine, session):
    """Every cache buffer's valid rows (rows of positions < length)."""
    n = engine.stage.cache.length(session)
    return {name: engine.stage.cache.buffer(session, name)[: n // spec.per].clone()
            for name, spec in engine.stage.cache.specs.items()}


def _same_sessions(e, a, b, n):
    assert e.length(a) == e.length(b) == n and e.tokens(a) == e.tokens(b)
    assert np.array_equal(e.history.compressed(a), e.history.compressed(b))
    rows_a, rows_b = _cache_rows(e, a), _cache_rows(e, b)
    assert rows_a.keys() == rows_b.keys() and any(k.startswith("dspark_window") for k in rows_a)
    for name in rows_a:
        assert torch.equal(rows_a[name], rows_b[name]), name


@pytest.mark.parametrize("exact", [False, True])
def test_rollback_equals_a_session_that_never_drafted(exact):
    e = Engine(V41_SMALL, speculative="dspark:exact" if exact else "dspark")
    ids = torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    a, b = e.open(), e.open()
    e.prefill(a, ids[:23])
    e.prefill(b, ids[:23])
    # a whole block rejected, its first token included: positions 23.. leave every component
    verify(e, a, [ids[23], 77, 78], 23)
    e.rollback(a, 23)
    _same_sessions(e, a, b, 23)
    nxt = 23
    if exact:  # the block's first token and one draft kept, the last draft dropped
        verify(e, a, ids[23:25] + [99], 23)
        e.rollback(a, 25)
        e.decode_step({b: ids[23]}), e.decode_step({b: ids[24]})
        _same_sessions(e, a, b, 25)
        nxt = 25
    assert torch.equal(e.decode_step({a: ids[nxt]})[a], e.decode_step({b: ids[nxt]})[b])
    da, db = e.stage.draft(a, 7), e.stage.draft(b, 7)
    assert da.tokens == db.tokens and torch.equal(da.logits, db.logits)
    e.shutdown()


def test_greedy_acceptance_takes_the_longest_matching_prefix():
    rows = torch.full((4, 6), -1.0)
    for i, best in enumerate([2, 4, 1, 5]):
        rows[i, best] = 1.0
    assert (accept_greedy(rows, [2, 4, 1]).accepted, accept_greedy(rows, [2, 4, 1]).next_token) == (3, 5)
    assert (accept_greedy(rows, [2, 3, 1]).accepted, accept_greedy(rows, [2, 3, 1]).next_token) == (1, 4)
    assert (accept_greedy(rows, [0, 4, 1]).accepted, accept_greedy(rows, [0, 4, 1]).next_token) == (0, 2)
    assert accept_greedy(rows[:1], []).next_token == 2


def _chi_square(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def test_speculative_sampling_keeps_the_target_distribution():
    """Tokens 1 and 2 of a step, over 20k steps with drafts drawn from a different distribution."""
    sampling = Sampling(temperature=0.8, seed=11)
    g = torch.Generator().manual_seed(5)
    target = torch.randn(3, 5, generator=g) * 1.5
    draft = torch.randn(2, 5, generator=g) * 1.5
    p = [torch.softmax(target[i].double() / 0.8, -1).numpy() for i in range(3)]
    q = torch.softmax(draft.double() / 0.8, -1)
    first, second = np.zeros(5), np.zeros(5)
    for trial in range(20_000):
        gen = torch.Generator().manual_seed(1000 + trial)
        drafts = [int(torch.multinomial(q[i], 1, generator=gen)) for i in range(2)]
        v = accept_sampled(target, draft, drafts, sampling, gen)
        emitted = drafts[:v.accepted] + [v.next_token]
        first[emitted[0]] += 1
        if len(emitted) > 1:
            second[emitted[1]] += 1
    # chi-square, 4 degrees of freedom: 18.47 is the 0.1 % point
    assert _chi_square(first, p[0]) < 18.47, first
    assert _chi_square(second, p[1]) < 18.47, second
    assert second.sum() > 2000  # drafts were accepted often enough for the second check to mean something


def test_sampled_speculative_run_is_seeded_and_uses_the_draft_layers():
    e = Engine(V41_SMALL, speculative="dspark")
    sampling = Sampling(temperature=1.0, top_k=50, seed=3)
    prompts = [PROMPT, [9, 8, 7]]
    a = [g.tokens for g in e.generate(prompts, max_new_tokens=12, sampling=sampling)]
    stats = e.speculative_stats
    b = [g.tokens for g in e.generate(prompts, max_new_tokens=12, sampling=sampling, in_flight=2)]
    c = [g.tokens for g in e.generate(prompts, max_new_tokens=12, sampling=Sampling(temperature=1.0, top_k=50, seed=4))]
    e.shutdown()
    assert a == b != c  # the draws depend on the seed only, not on the steps in flight
    assert all(len(t) == 12 and all(0 <= x < 512 for x in t) for t in a)
    assert stats.drafted > 0 and stats.emitted == 22
