"""A small LRU of loaded models, keyed by model id (or folder), with hit/miss counters for the metrics.

Distinct from :mod:`alloy.storage.model_cache` (which resolves model ids to local folders): this one keeps the loaded
torch modules and tokenizers, which take seconds to build."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable

from alloy.evaluation.loading import LoadedModel


class LoadedModelCache:
    def __init__(self, capacity: int = 2):
        self.capacity = capacity
        self._entries: OrderedDict[str, LoadedModel] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get(self, key: str, load: Callable[[], LoadedModel]) -> LoadedModel:
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
                self.hits += 1
                return self._entries[key]
            self.misses += 1
        loaded = load()  # outside the lock: loading takes seconds
        if self.capacity > 0:
            with self._lock:
                self._entries[key] = loaded
                self._entries.move_to_end(key)
                while len(self._entries) > self.capacity:
                    self._entries.popitem(last=False)
        return loaded

    def invalidate(self, key: str) -> None:
        with self._lock:
            self._entries.pop(key, None)

    def clear(self) -> int:
        """Drop every entry and reset the counters (the hit rate reads zero right after)."""
        with self._lock:
            dropped = len(self._entries)
            self._entries.clear()
            self.hits = self.misses = 0
            return dropped

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"size": len(self._entries), "capacity": self.capacity, "hits": self.hits, "misses": self.misses}
