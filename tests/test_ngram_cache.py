"""The plant's n-gram cache over recent answers (node_agent/ngram_cache.py): what it drafts,
longest n-gram first, and that it never holds more than its bound, dropping the least
recently used n-gram first. Drafts from it change no token: that is
test_speculation.py's, through a plant."""

from __future__ import annotations

import pytest

from node_agent.ngram_cache import CONTINUATION, NgramCache


def _cache(entries: int = 1000, *, low: int = 2, high: int = 4) -> NgramCache:
    return NgramCache(entries, min_ngram=low, max_ngram=high)


def test_a_lookup_gives_what_followed_the_n_gram_in_an_earlier_text() -> None:
    cache = _cache()
    cache.add([5, 6, 7, 8, 9, 10, 11])
    assert cache.lookup([1, 2, 6, 7], most=3) == [8, 9, 10]
    assert cache.lookup([1, 2, 6, 7], most=1) == [8]
    assert cache.lookup([7, 6], most=3) == []  # never seen in that order
    assert cache.lookup([11], most=3) == []  # shorter than min_ngram: a match is chance


def test_the_continuation_is_at_most_a_frame_of_tokens() -> None:
    cache = _cache()
    text = list(range(100, 100 + 2 + 3 * CONTINUATION))
    cache.add(text)
    assert cache.lookup(text[:2], most=100) == text[2:2 + CONTINUATION]


def test_the_longest_n_gram_held_decides() -> None:
    cache = _cache()
    cache.add([1, 2, 3, 40, 41])  # after the 3-gram 1 2 3 (and the 2-gram 2 3): 40
    cache.add([9, 2, 3, 50, 51])  # after the 2-gram 2 3, later: 50
    assert cache.lookup([0, 2, 3], most=2) == [50, 51]  # only the 2-gram matches
    assert cache.lookup([1, 2, 3], most=2) == [40, 41]  # the 3-gram wins over the later 2-gram


def test_a_later_text_replaces_what_followed_an_n_gram() -> None:
    cache = _cache()
    cache.add([1, 2, 3, 4])
    cache.add([1, 2, 3, 7])
    assert cache.lookup([1, 2, 3], most=1) == [7]


def test_the_bound_holds_and_the_least_recently_used_n_gram_goes_first() -> None:
    cache = _cache(entries=3, low=2, high=2)
    cache.add([1, 2, 10])  # holds (1 2)
    cache.add([3, 4, 11])  # (3 4)
    cache.add([5, 6, 12])  # (5 6)
    assert len(cache) == 3
    assert cache.lookup([1, 2], most=1) == [10]  # used: (3 4) is now the oldest
    cache.add([7, 8, 13])  # (7 8) in: (3 4) out
    assert len(cache) == 3
    assert cache.lookup([3, 4], most=1) == []
    assert [cache.lookup(ngram, most=1) for ngram in ([1, 2], [5, 6], [7, 8])] == [
        [10], [12], [13]]


def test_a_text_longer_than_the_bound_keeps_its_last_n_grams() -> None:
    cache = _cache(entries=50)
    text = list(range(1000, 1500))
    cache.add(text)
    assert len(cache) == 50
    assert cache.lookup(text[-5:-1], most=1) == [text[-1]]
    assert cache.lookup(text[:4], most=1) == []


@pytest.mark.parametrize(("entries", "low", "high"), [(0, 2, 4), (10, 3, 2), (10, 0, 2)])
def test_a_cache_without_room_or_with_lengths_out_of_order_is_refused(
        entries: int, low: int, high: int) -> None:
    with pytest.raises(ValueError):
        _cache(entries, low=low, high=high)

