import numpy as np
import pytest

from engramflow.errors import EngramflowError
from engramflow.kernels.hashing import DEAD, hash_window
from hash_oracle import hash_reference
from engramflow.memory.history import SessionHistory
from engramflow.io.layout import build_layout
from engramflow.io.token_map import TokenMap
from engramflow.io.config import from_dict
from engramflow.io.presets import PRESETS


@pytest.fixture(scope="module")
def tiny_layout():
    # 2 n-gram sizes (2, 3) x 2 heads: primes [[11, 13, 17, 19], [23, 29, 31, 37]]
    raw = dict(PRESETS["deepseek-v4.1-flash"]) | {"engram_vocab_size": 10, "engram_n_heads": 2,
                                                  "engram_max_ngram_size": 3}
    return build_layout(from_dict(raw))


def test_hand_computed_addresses(tiny_layout):
    # identity token map: compressed id == token id; pad token id 2 -> compressed 2
    hist = SessionHistory(tiny_layout, TokenMap(np.arange(1000)), pad_token_id=2)
    s = hist.open()
    got = hist.append(s, [5, 7, 9])
    P = 2
    for li, (primes, offsets) in enumerate([([11, 13, 17, 19], [0, 11, 24, 41]),
                                            ([23, 29, 31, 37], [0, 23, 52, 83])]):
        m = [int(v) for v in tiny_layout.multipliers[li]]
        for pos, toks in enumerate([(5, P, P), (7, 5, P), (9, 7, 5)]):
            bi = (toks[0] * m[0]) ^ (toks[1] * m[1])  # 2-gram
            tri = bi ^ (toks[2] * m[2])  # 3-gram
            expect = [bi % primes[0] + offsets[0], bi % primes[1] + offsets[1],
                      tri % primes[2] + offsets[2], tri % primes[3] + offsets[3]]
            assert got[pos, li].tolist() == expect


def test_dead_blocks_every_farther_lookback(tiny_layout):
    hist = SessionHistory(tiny_layout, TokenMap(np.arange(1000)), pad_token_id=2)
    got = hist.append(hist.open(), [5, 7, 9, 11], dead_mask=np.array([False, True, False, False]))
    # position 2 sees (9, DEAD, ...) -> (9, pad, pad): same as a session that starts at 9
    fresh = hist.append(hist.open(), [9, 11])
    assert np.array_equal(got[2:], fresh)


def test_vectorized_matches_scalar_reference_on_random_input(v41_layout, rng):
    window = rng.integers(0, 99_092, 300)
    window[rng.random(300) < 0.05] = DEAD
    got = hash_window(window, 0, v41_layout, pad=7)
    assert np.array_equal(got, np.array(hash_reference(window.tolist(), v41_layout, 7)))


@pytest.fixture
def history(v41_layout, v4_token_map):
    return SessionHistory(v41_layout, v4_token_map, pad_token_id=2)


def test_prefill_equals_token_by_token(history, rng):
    ids = rng.integers(0, 129_280, 200)
    a, b = history.open(), history.open()
    whole = history.append(a, ids)
    steps = np.concatenate([history.append(b, [int(t)]) for t in ids])
    assert whole.shape == (200, 2, 24)
    assert np.array_equal(whole, steps)
    # chunked prefill in uneven pieces too
    c = history.open()
    cuts = np.sort(rng.choice(np.arange(1, 200), 5, replace=False))
    chunks = np.concatenate([history.append(c, part) for part in np.split(ids, cuts)])
    assert np.array_equal(whole, chunks)


def test_rollback_then_reappend_equals_fresh_run(history, rng):
    ids = rng.integers(0, 129_280, 64)
    alt = rng.integers(0, 129_280, 20)
    s = history.open()
    history.append(s, ids)
    got = history.append(s, alt, start_pos=30)
    assert history.length(s) == 50
    fresh = history.open()
    ref = history.append(fresh, np.concatenate([ids[:30], alt]))
    assert np.array_equal(got, ref[30:])
    assert np.array_equal(history.compressed(s), history.compressed(fresh))


def test_forks_are_isolated(history, rng):
    base = rng.integers(0, 129_280, 40)
    s = history.open("parent")
    history.append(s, base)
    child = history.fork(s, "child")
    a = history.append(s, [11, 12, 13])
    b = history.append(child, [21, 22, 23])
    assert history.length(s) == history.length(child) == 43
    solo = history.open()
    assert np.array_equal(history.append(solo, np.concatenate([base, [21, 22, 23]]))[40:], b)
    history.reset(solo)
    assert np.array_equal(history.append(solo, np.concatenate([base, [11, 12, 13]]))[40:], a)


def test_ngrams_never_cross_a_dead_span(history, rng):
    ids = rng.integers(0, 129_280, 120)
    start, end = 50, 57
    dead = np.zeros(120, dtype=bool)
    dead[start:end] = True
    got = history.append(history.open(), ids, dead_mask=dead)
    after = history.append(history.open(), ids[end:])  # a session that starts after the span
    assert np.array_equal(got[end:], after)
    before = history.append(history.open(), ids[:start])
    assert np.array_equal(got[:start], before)


def test_decode_cost_does_not_depend_on_history_length(history, rng):
    # O(1) decode: the window handed to the kernel is at most max_ngram long
    s = history.open()
    history.append(s, rng.integers(0, 129_280, 5000))
    ref = history.compressed(s)
    one = history.append(s, [42])
    assert one.shape == (1, 2, 24)
    assert np.array_equal(history.compressed(s)[:-1], ref)


@pytest.mark.parametrize("call,match", [
    (lambda h, s: h.append(s, [1, 129_280]), "out of range"),
    (lambda h, s: h.append(s, [1.0, 2.0]), "must be integers"),
    (lambda h, s: h.append(s, [1], start_pos=11), r"start_pos=11 is outside \[0, 10\]"),
    (lambda h, s: h.append(s, [1], start_pos=-1), "start_pos=-1"),
    (lambda h, s: h.append(s, [1, 2], dead_mask=[True]), "dead_mask"),
    (lambda h, s: h.append("ghost", [1]), "unknown session 'ghost'"),
    (lambda h, s: h.open(s), "already exists"),
    (lambda h, s: h.fork("ghost"), "unknown session"),
])
def test_bad_input_leaves_state_unchanged(history, rng, call, match):
    s = history.open()
    history.append(s, rng.integers(0, 129_280, 10))
    before = history.compressed(s)
    with pytest.raises(EngramflowError, match=match):
        call(history, s)
    assert np.array_equal(history.compressed(s), before)


def test_close_and_double_close(history):
    s = history.open()
    history.append(s, [1, 2, 3])
    history.close(s)
    assert s not in history.sessions
    with pytest.raises(EngramflowError, match="unknown session"):
        history.close(s)
    with pytest.raises(EngramflowError, match="unknown session"):
        history.append(s, [1])
