"""Resolved models for the merge engine: model id -> (local folder, manifest), bounded in bytes.

Resolving a model means asking the registry for its manifest and a local folder with its files (which, for an
S3-backed artifact store, is a download). Engines that run many jobs on the same few models hit this cache
instead. An entry is keyed by model id *and* the registry's fingerprint, so a model deleted and re-registered
under the same id is never served stale; one whose folder vanished is resolved again.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from alloy.model_manifest import ModelManifest
from alloy.storage.lru import CacheStats, LruCache


@dataclass(frozen=True)
class CachedModel:
    model_id: str
    local_dir: Path
    manifest: ModelManifest
    size_bytes: int


class ModelCache:
    def __init__(self, resolve: Callable[[str], CachedModel], capacity_bytes: int):
        self._resolve = resolve
        self._lru: LruCache[CachedModel] = LruCache(capacity_bytes, size_of=lambda entry: entry.size_bytes)

    def get(self, model_id: str, fingerprint: str | None = None) -> CachedModel:
        key = f"{model_id}@{fingerprint}" if fingerprint else model_id
        return self._lru.get(key, lambda: self._resolve(model_id), still_valid=lambda e: e.local_dir.exists())

    def clear(self) -> int:
        return self._lru.clear()

    def stats(self) -> CacheStats:
        return self._lru.stats()
