"""An LRU cache of resolved models for the engines: model id -> (local folder, manifest), bounded in bytes.

Resolving a model means asking the registry for its manifest and a local folder with its files (which, for an
S3-backed artifact store, is a download). Engines that run many jobs on the same few models hit this cache
instead. Hit rate is exported as a metric; ``clear()`` (DELETE /admin/cache) drops everything and resets the
counters, so the hit rate reads zero right after.

An entry is keyed by model id *and* the registry's fingerprint, so a model deleted and re-registered under the
same id is never served stale.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from pydantic import BaseModel


@dataclass(frozen=True)
class CachedModel:
    model_id: str
    local_dir: Path
    manifest: Any
    size_bytes: int


class CacheStats(BaseModel):
    entries: int
    bytes: int
    capacity_bytes: int
    hits: int
    misses: int
    hit_rate: float


class ModelCache:
    def __init__(self, resolve: Callable[[str], CachedModel], capacity_bytes: int):
        self._resolve = resolve
        self._capacity = capacity_bytes
        self._entries: OrderedDict[str, CachedModel] = OrderedDict()
        self._bytes = 0
        self._hits = 0
        self._misses = 0
        self._lock = threading.Lock()

    def get(self, model_id: str, fingerprint: str | None = None) -> CachedModel:
        key = f"{model_id}@{fingerprint}" if fingerprint else model_id
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and entry.local_dir.exists():
                self._entries.move_to_end(key)
                self._hits += 1
                return entry
            self._misses += 1
        entry = self._resolve(model_id)  # outside the lock: may download
        with self._lock:
            self._insert(key, entry)
        return entry

    def _insert(self, key: str, entry: CachedModel) -> None:
        previous = self._entries.pop(key, None)
        if previous is not None:
            self._bytes -= previous.size_bytes
        if entry.size_bytes > self._capacity:
            return  # bigger than the whole cache: serve it, keep nothing
        self._entries[key] = entry
        self._bytes += entry.size_bytes
        while self._bytes > self._capacity and self._entries:
            _, evicted = self._entries.popitem(last=False)
            self._bytes -= evicted.size_bytes

    def clear(self) -> CacheStats:
        with self._lock:
            self._entries.clear()
            self._bytes = self._hits = self._misses = 0
        return self.stats()

    def stats(self) -> CacheStats:
        with self._lock:
            lookups = self._hits + self._misses
            return CacheStats(
                entries=len(self._entries), bytes=self._bytes, capacity_bytes=self._capacity, hits=self._hits,
                misses=self._misses, hit_rate=(self._hits / lookups) if lookups else 0.0,
            )
