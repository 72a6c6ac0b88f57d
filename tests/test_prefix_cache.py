"""PrefixCache alone (no Ray, no runner): longest-prefix lookup, LRU eviction within the byte
budget, redundant entries dropped, and that whatever leaves the cache is closed exactly once."""
import numpy as np
import pytest

from engramflow.errors import EngramflowError
from engramflow.scheduling.prefix_cache import PrefixCache, common_prefix
from engramflow.scheduling.prefix_key import prompt_key


def make(budget_tokens: int, token_bytes: int = 10):
    closed = []
    return PrefixCache(budget_tokens * token_bytes, token_bytes, closed.append), closed


def k(*ids):
    return np.array(ids, dtype=np.int64)


def test_common_prefix():
    assert common_prefix(k(1, 2, 3), k(1, 2, 4)) == 2
    assert common_prefix(k(1, 2), k(1, 2, 3)) == 2
    assert common_prefix(k(5), k(1)) == 0
    assert common_prefix(k(), k(1)) == 0


def test_lookup_finds_the_longest_shared_prefix_and_caps_it():
    cache, closed = make(100)
    cache.insert("a", k(1, 2, 3, 4))
    cache.insert("b", k(1, 2, 9, 9, 9))
    assert cache.lookup(k(1, 2, 3, 4, 5, 6), limit=5) == ("a", 4)
    assert cache.lookup(k(1, 2, 9, 9, 7), limit=4) == ("b", 4)
    assert cache.lookup(k(1, 2, 3, 4), limit=3) == ("a", 3)  # the last prompt token is always prefilled
    assert cache.lookup(k(7, 1, 2), limit=2) is None
    assert closed == []


def test_lru_eviction_keeps_the_budget_and_closes_what_it_drops():
    cache, closed = make(10)  # room for 10 tokens
    cache.insert("a", k(1, 1, 1, 1))
    cache.insert("b", k(2, 2, 2, 2))
    cache.lookup(k(1, 1, 5), limit=2)  # "a" used: "b" is now the oldest
    cache.insert("c", k(3, 3, 3, 3))
    assert closed == ["b"] and "a" in cache and "c" in cache
    assert cache.bytes == 80 <= cache.budget and cache.evictions == 1


def test_a_session_too_big_for_the_budget_is_closed_not_kept():
    cache, closed = make(3)
    assert not cache.insert("a", k(1, 2, 3, 4))
    assert closed == ["a"] and len(cache) == 0 and cache.bytes == 0
    zero, closed0 = make(0)
    assert not zero.insert("z", k(1)) and closed0 == ["z"]


def test_an_entry_that_is_a_prefix_of_a_new_one_is_dropped():
    cache, closed = make(100)
    cache.insert("turn1", k(1, 2, 3))
    cache.insert("turn2", k(1, 2, 3, 4, 5))
    assert closed == ["turn1"] and len(cache) == 1 and cache.bytes == 50
    assert not cache.insert("again", k(1, 2, 3))  # covered by turn2: nothing new to keep
    assert closed == ["turn1", "again"] and cache.bytes == 50


def test_clear_closes_everything_once_and_forget_closes_nothing():
    cache, closed = make(100)
    cache.insert("a", k(1))
    cache.insert("b", k(2))
    cache.forget({"b"})
    assert closed == [] and len(cache) == 1 and cache.bytes == 10
    cache.clear()
    assert closed == ["b"] and cache.bytes == 0


def test_stats_count_hits_and_tokens():
    cache, _ = make(100)
    cache.insert("a", k(1, 2, 3))
    found = cache.lookup(k(1, 2, 3, 4), limit=3)
    cache.hit(found[1])
    cache.lookup(k(9, 9), limit=1)
    s = cache.stats()
    assert (s["lookups"], s["hits"], s["cached_tokens"], s["prompt_tokens"]) == (2, 1, 3, 6)
    assert s["hit_rate"] == 0.5


@pytest.mark.parametrize("budget,token", [(-1, 10), (1.5, 10), (True, 10), (10, 0), (10, 2.0)])
def test_bad_numbers_are_refused_naming_the_value(budget, token):
    with pytest.raises(EngramflowError, match=repr(budget) if budget in (-1, 1.5, True) else repr(token)):
        PrefixCache(budget, token, lambda s: None)


class _Image:
    """A PreparedImage's shape for the key: its patches and span."""

    def __init__(self, fill: int, span: int):
        import torch

        self.patches = torch.full((2, 3, 2, 2), fill, dtype=torch.bfloat16)
        self.span_tokens = span


def test_an_image_key_is_its_pixels_never_the_placeholder_or_another_image():
    img = 99
    a = prompt_key([5, img, 6], [_Image(1, 3)], img)
    same = prompt_key([5, img, 6], [_Image(1, 3)], img)
    other = prompt_key([5, img, 6], [_Image(2, 3)], img)
    assert a.key.size == 5 and (a.key[1:4] < 0).all() and a.key[0] == 5 and a.key[4] == 6
    assert np.array_equal(a.key, same.key)
    assert common_prefix(a.key, other.key) == 1  # a different image shares nothing past the text before it
    assert common_prefix(a.key, prompt_key([5, img, 6], [], img).key) == 1  # nor does the placeholder as text
    assert a.cut(3) == 1 and a.cut(4) == 4 and a.cut(1) == 1  # a prefix never splits a span
    assert a.split(4) == (2, 1) and a.split(1) == (1, 0)  # (index in the ids, images before)
