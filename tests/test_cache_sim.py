"""Cache simulation against plain simulations: an OrderedDict LRU and a counted top-N set."""
from collections import Counter, OrderedDict

import numpy as np
import pytest

from engramflow.data.access.cache_sim import (NO_PREVIOUS, hit_rate_curves, lru_hit_rates, sizes_up_to, stack_distances,
                                       static_hit_rates)


def lru_hits(stream, n):
    cache, hits = OrderedDict(), []
    for x in stream:
        hit = x in cache
        hits.append(hit)
        if hit:
            cache.move_to_end(x)
        else:
            cache[x] = None
            if len(cache) > n:
                cache.popitem(last=False)
    return hits


def direct_distances(stream):
    out = []
    for i, x in enumerate(stream):
        prev = max((j for j in range(i) if stream[j] == x), default=None)
        out.append(NO_PREVIOUS if prev is None else len(set(stream[prev + 1:i])))
    return out


@pytest.mark.parametrize("n,universe", [(1, 1), (2, 1), (7, 3), (64, 10), (300, 40), (513, 500), (1000, 30)])
def test_stack_distances_equal_a_direct_count(n, universe, rng):
    stream = rng.integers(0, universe, n)
    assert stack_distances(stream).tolist() == direct_distances(stream.tolist())


def test_lru_and_static_equal_plain_simulations(rng):
    stream = np.concatenate([rng.zipf(1.3, 3000) % 700, rng.integers(0, 50, 500), np.full(40, 9)])
    half = stream.size // 2
    sizes = [1, 2, 5, 17, 100, 699, 5000]
    d = stack_distances(stream)
    assert lru_hit_rates(d, sizes) == [sum(lru_hits(stream.tolist(), n)) / stream.size for n in sizes]
    curves = hit_rate_curves(stream, sizes)
    for n, rate in zip(sizes, curves["lru"]):
        assert rate == sum(lru_hits(stream.tolist(), n)[half:]) / (stream.size - half)
    counts = Counter(stream[:half].tolist())
    ranked = [r for r, _ in sorted(counts.items(), key=lambda rc: (-rc[1], rc[0]))]
    for n, rate in zip(sizes, curves["static"]):
        hot = set(ranked[:n])
        assert rate == sum(x in hot for x in stream[half:].tolist()) / (stream.size - half)
    assert curves["accesses"] == stream.size and curves["distinct_rows"] == np.unique(stream).size
    assert static_hit_rates(np.array([1, 1, 2]), np.array([3, 1]), [1, 2]) == [0.5, 0.5]


def test_edge_cases():
    assert stack_distances(np.array([], np.int64)).size == 0
    assert stack_distances([5, 5, 5]).tolist() == [NO_PREVIOUS, 0, 0]
    assert stack_distances([1, 2, 3, 1]).tolist() == [NO_PREVIOUS] * 3 + [2]
    assert sizes_up_to(1) == [1] and sizes_up_to(30) == [1, 2, 5, 10, 20, 50]
