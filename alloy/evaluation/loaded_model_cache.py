"""Loaded models of the evaluation engine (torch modules and tokenizers take seconds to build), keyed by model
id or folder and bounded in entries; the LRU and its stats are :mod:`alloy.storage.lru`'s."""

from __future__ import annotations

from collections.abc import Callable

from alloy.evaluation.loading import LoadedModel
from alloy.storage.lru import CacheStats, LruCache


class LoadedModelCache:
    def __init__(self, capacity: int = 2):
        self._lru: LruCache[LoadedModel] = LruCache(capacity)

    def get(self, key: str, load: Callable[[], LoadedModel]) -> LoadedModel:
        return self._lru.get(key, load)

    def invalidate(self, key: str) -> None:
        self._lru.invalidate(key)

    def clear(self) -> int:
        """Drop every entry and reset the counters (the hit rate reads zero right after)."""
        return self._lru.clear()

    def stats(self) -> CacheStats:
        return self._lru.stats()
