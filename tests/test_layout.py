import numpy as np

from engramflow.io.layout import build_layout, is_prime
from engramflow.io.config import from_dict
from engramflow.io.presets import PRESETS


def test_release_layout_prime_sums_equal_table_rows(v41_config, v41_layout):
    assert v41_layout.rows_needed.tolist() == list(v41_config.engram_num_embeddings)


def test_primes_are_distinct_primes_above_the_search_start(v41_config, v41_layout):
    primes = v41_layout.primes.reshape(-1).tolist()
    assert len(set(primes)) == len(primes) == 48
    assert all(is_prime(p) and p >= v41_config.engram_vocab_size for p in primes)
    # each (layer, n-gram) group of heads is increasing: the search continues from the last prime
    groups = v41_layout.primes.reshape(2, 3, 8)
    assert (np.diff(groups, axis=2) > 0).all()


def test_offsets_are_exclusive_cumulative_sums(v41_layout):
    for primes, offsets in zip(v41_layout.primes, v41_layout.offsets):
        assert offsets[0] == 0
        assert (offsets[1:] == np.cumsum(primes)[:-1]).all()


def test_multipliers_equal_the_official_code():
    """Against the multipliers DeepSeek's own engram.py computed (tests/data/official_multipliers.json,
    with its provenance), for the released layers and two small configs."""
    import json
    from pathlib import Path

    doc = json.loads((Path(__file__).parent / "data" / "official_multipliers.json").read_text())
    for case in doc["cases"]:
        cfg = from_dict(dict(PRESETS["deepseek-v4.1-flash"]) | {
            "engram_layer_ids": case["layer_ids"], "engram_max_ngram_size": case["max_ngram_size"],
            "engram_compressed_vocab_size": case["compressed_vocab_size"],
            "engram_num_embeddings": [1] * len(case["layer_ids"])})
        assert build_layout(cfg).multipliers.tolist() == case["multipliers"], case["layer_ids"]


def test_is_prime_against_a_sieve():
    n = 20_000
    sieve = np.ones(n, dtype=bool)
    sieve[:2] = False
    for i in range(2, int(n**0.5) + 1):
        if sieve[i]:
            sieve[i * i::i] = False
    assert [is_prime(i) for i in range(n)] == sieve.tolist()


def test_small_layout_search_skips_primes_used_by_earlier_layers():
    raw = dict(PRESETS["deepseek-v4.1-flash"]) | {"engram_vocab_size": 10, "engram_n_heads": 2,
                                                  "engram_max_ngram_size": 3}
    layout = build_layout(from_dict(raw))
    # layer 1: 2-grams 11, 13; 3-grams restart at 9 and skip 11, 13 -> 17, 19; layer 14 continues
    assert layout.primes.tolist() == [[11, 13, 17, 19], [23, 29, 31, 37]]
