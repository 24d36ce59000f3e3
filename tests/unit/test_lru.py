"""The one LRU of the engines (alloy.storage.lru): eviction order, byte bounds, too-large values, stats."""

from __future__ import annotations

from alloy.storage.lru import LruCache


def test_least_recently_used_goes_first_and_stats_count_hits():
    cache: LruCache[str] = LruCache(2)
    for key in ("a", "b"):
        cache.get(key, lambda key=key: key.upper())
    assert cache.get("a", lambda: "reloaded") == "A"  # a hit refreshes "a"
    cache.get("c", lambda: "C")  # evicts "b"
    assert cache.get("b", lambda: "B2") == "B2"
    stats = cache.stats()
    assert (stats.entries, stats.hits, stats.misses) == (2, 1, 4) and stats.hit_rate == 0.2


def test_a_byte_bounded_cache_serves_but_does_not_keep_a_value_bigger_than_itself():
    cache: LruCache[bytes] = LruCache(10, size_of=len)
    assert cache.get("big", lambda: b"x" * 11) == b"x" * 11
    cache.get("small", lambda: b"x" * 4)
    assert cache.stats().entries == 1 and cache.stats().size == 4


def test_an_entry_no_longer_valid_is_loaded_again():
    cache: LruCache[str] = LruCache(2)
    cache.get("k", lambda: "old")
    assert cache.get("k", lambda: "new", still_valid=lambda v: v != "old") == "new"


def test_clear_drops_entries_and_resets_the_hit_rate():
    cache: LruCache[int] = LruCache(3)
    cache.get(1, lambda: 1)
    cache.get(1, lambda: 1)
    assert cache.clear() == 1
    assert cache.stats().hit_rate == 0.0 and cache.stats().entries == 0


def test_capacity_zero_keeps_nothing():
    cache: LruCache[int] = LruCache(0)
    assert cache.get(1, lambda: 7) == 7 and cache.stats().entries == 0
