"""Resolved models for the merge engine: model id -> (local folder, manifest), bounded in bytes.

Resolving a model means asking the registry for its manifest and a local folder with its files (which, for an
S3-backed artifact store, is a download). Engines that run many jobs on the same few models hit this cache
instead. A file enters the cache verified: ``resolve`` is :meth:`alloy.registry.models.ModelRegistry.local_dir`,
which checks every file against the size and sha256 recorded at registration (and refuses a broken model). An
entry stays valid only while its folder's files are unchanged (each file's size and mtime, checked on every hit),
so a file rewritten in place (bit flips of the same size included) or a model re-registered under the same id is
resolved, and so verified, again.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from alloy.model_manifest import ModelManifest
from alloy.storage.integrity import folder_signature
from alloy.storage.lru import CacheStats, LruCache


@dataclass(frozen=True)
class CachedModel:
    model_id: str
    local_dir: Path
    manifest: ModelManifest
    size_bytes: int
    signature: tuple = field(default=(), compare=False)  # the files as they were when verified


def _files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.is_file()) if folder.is_dir() else []


class ModelCache:
    def __init__(self, resolve: Callable[[str], CachedModel], capacity_bytes: int):
        self._resolve = resolve
        self._lru: LruCache[CachedModel] = LruCache(capacity_bytes, size_of=lambda entry: entry.size_bytes)

    def get(self, model_id: str, fingerprint: str | None = None) -> CachedModel:
        key = f"{model_id}@{fingerprint}" if fingerprint else model_id
        return self._lru.get(key, lambda: self._load(model_id), still_valid=self._unchanged)

    def _load(self, model_id: str) -> CachedModel:
        entry = self._resolve(model_id)
        signature = folder_signature(entry.local_dir, _files(entry.local_dir))
        return CachedModel(entry.model_id, entry.local_dir, entry.manifest, entry.size_bytes, signature)

    @staticmethod
    def _unchanged(entry: CachedModel) -> bool:
        return (
            entry.local_dir.is_dir() and folder_signature(entry.local_dir, _files(entry.local_dir)) == entry.signature
        )

    def clear(self) -> int:
        return self._lru.clear()

    def stats(self) -> CacheStats:
        return self._lru.stats()
