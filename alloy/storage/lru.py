"""The one LRU cache of the engines (cachetools underneath) and its one stats shape.

Two caches use it: resolved models of the merge engine (bounded in bytes) and loaded torch models of the
evaluation engine (bounded in entries). Loading happens outside the lock (it may download or take seconds);
``clear()`` (DELETE /admin/cache) drops every entry and resets the counters, so the hit rate reads zero after.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

from cachetools import LRUCache
from pydantic import BaseModel

V = TypeVar("V")


class CacheStats(BaseModel):
    """``size`` and ``capacity`` are in the cache's unit: bytes for a byte-bounded cache, else entries."""

    entries: int
    size: int
    capacity: int
    hits: int
    misses: int
    hit_rate: float


class LruCache(Generic[V]):
    def __init__(self, capacity: int, *, size_of: Callable[[V], int] | None = None):
        self.capacity = capacity
        self._entries: LRUCache[Hashable, V] = LRUCache(maxsize=capacity, getsizeof=size_of)
        self._lock = threading.Lock()
        self._hits = self._misses = 0

    def get(self, key: Hashable, load: Callable[[], V], *, still_valid: Callable[[V], bool] | None = None) -> V:
        """The cached value of ``key`` (counted as a hit), else ``load()``'s (a miss), kept if it fits."""
        with self._lock:
            value = self._entries.get(key)
            if value is not None and (still_valid is None or still_valid(value)):
                self._hits += 1
                return value
            self._misses += 1
        value = load()
        with self._lock:
            try:
                self._entries[key] = value
            except ValueError:
                self._entries.pop(key, None)  # bigger than the whole cache: served, not kept
        return value

    def invalidate(self, key: Hashable) -> None:
        with self._lock:
            self._entries.pop(key, None)

    def clear(self) -> int:
        """Drop every entry and reset the counters; returns how many entries were dropped."""
        with self._lock:
            dropped = len(self._entries)
            self._entries.clear()
            self._hits = self._misses = 0
            return dropped

    def stats(self) -> CacheStats:
        with self._lock:
            lookups = self._hits + self._misses
            return CacheStats(
                entries=len(self._entries),
                size=int(self._entries.currsize),
                capacity=self.capacity,
                hits=self._hits,
                misses=self._misses,
                hit_rate=(self._hits / lookups) if lookups else 0.0,
            )
