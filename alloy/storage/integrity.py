"""File integrity: each file's size and sha256 as recorded when it was published, checked before it is read.

A model's files are hashed when they are registered (:func:`digest_files`, or while they are copied into the
store). :class:`FileVerifier` checks a folder against that record before a merge, an evaluation or an evolution
reads it, and remembers every file it verified by ``(path, size, mtime)``: a folder is hashed once per process,
and again only when one of its files changes (a rewrite, even of the same size, moves its mtime). The start-up
consistency check verifies everything afresh (``remember=False``). Truncation is also caught without a record:
a safetensors file must end where its header says its data ends (:func:`safetensors_problem`).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import threading
from collections.abc import Iterable, Mapping
from pathlib import Path

from pydantic import BaseModel

from alloy.errors import AlloyError, ErrorCode

CHUNK_BYTES = 8 * 1024 * 1024
MAX_HEADER_BYTES = 100 * 1024 * 1024
REMEMBERED_FILES = 65536  # bounded memory: beyond it the memo starts over (files are re-hashed, never trusted)


class FileRecord(BaseModel):
    size: int
    sha256: str


FileRecords = Mapping[str, FileRecord]  # file name relative to the folder -> what it must be


class Damage(BaseModel):
    """What is wrong with one file of a folder."""

    file: str
    reason: str

    def describe(self) -> str:
        return f"file {self.file!r} {self.reason}"


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def digest_files(folder: Path, names: Iterable[str]) -> dict[str, FileRecord]:
    """The record of ``names`` inside ``folder`` as they are now."""
    return {name: FileRecord(size=(folder / name).stat().st_size, sha256=sha256_file(folder / name)) for name in names}


def safetensors_problem(path: Path) -> str | None:
    """Why a safetensors file is structurally damaged (bad header, truncated, trailing bytes), or None."""
    size = path.stat().st_size
    with open(path, "rb") as handle:
        raw = handle.read(8)
        if len(raw) != 8:
            return "is truncated (no safetensors header)"
        (length,) = struct.unpack("<Q", raw)
        if length <= 0 or length > MAX_HEADER_BYTES or 8 + length > size:
            return "is truncated or damaged (bad safetensors header length)"
        try:
            header = json.loads(handle.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError):
            return "is damaged (unreadable safetensors header)"
    if not isinstance(header, dict):
        return "is damaged (unreadable safetensors header)"
    ends = [
        entry["data_offsets"][1]
        for name, entry in header.items()
        if name != "__metadata__" and isinstance(entry, dict) and isinstance(entry.get("data_offsets"), list)
    ]
    expected = 8 + length + max(ends, default=0)
    if size < expected:
        return f"is truncated ({size} bytes, its header needs {expected})"
    if size > expected:
        return f"has {size - expected} bytes after its last tensor"
    return None


class FileVerifier:
    """Checks folders against their records; thread-safe; remembers verified files by (path, size, mtime)."""

    def __init__(self) -> None:
        self._verified: dict[tuple[str, int, int], str] = {}  # (path, size, mtime_ns) -> sha256 it had
        self._lock = threading.Lock()

    def check(self, folder: Path, expected: FileRecords, *, remember: bool = True) -> Damage | None:
        """The first damaged file of ``folder`` (missing, another size, another sha256, a truncated
        safetensors file), or None when every file matches its record."""
        for name in sorted(expected):
            damage = self._check_file(folder, name, expected[name], remember)
            if damage is not None:
                return damage
        return None

    def remember(self, folder: Path, expected: FileRecords) -> None:
        """Files just verified by someone else (a download that hashed what it wrote)."""
        for name, record in expected.items():
            key = _stat_key(folder / name)
            if key is not None and key[1] == record.size:
                self._store(key, record.sha256)

    def _check_file(self, folder: Path, name: str, record: FileRecord, remember: bool) -> Damage | None:
        path = folder / name
        key = _stat_key(path)
        if key is None:
            return Damage(file=name, reason="is missing")
        if key[1] != record.size:
            return Damage(file=name, reason=f"has {key[1]} bytes, {record.size} were registered")
        with self._lock:
            known = self._verified.get(key) if remember else None
        if known == record.sha256:
            return None
        if name.endswith(".safetensors"):
            problem = safetensors_problem(path)
            if problem is not None:
                return Damage(file=name, reason=problem)
        actual = sha256_file(path)
        if actual != record.sha256:
            return Damage(file=name, reason=f"does not match its registered sha256 (content changed: {actual[:12]}...)")
        if remember and _stat_key(path) == key:  # unchanged while it was hashed
            self._store(key, actual)
        return None

    def _store(self, key: tuple[str, int, int], sha256: str) -> None:
        with self._lock:
            if len(self._verified) >= REMEMBERED_FILES:
                self._verified.clear()
            self._verified[key] = sha256


def _stat_key(path: Path) -> tuple[str, int, int] | None:
    try:
        stat = os.stat(path)
    except OSError:
        return None
    return str(path.resolve()), stat.st_size, stat.st_mtime_ns


def folder_signature(folder: Path, names: Iterable[str]) -> tuple[tuple[str, int, int] | None, ...]:
    """What changes when any of the files changes (size or mtime), or goes: for caches of verified folders."""
    return tuple(_stat_key(folder / name) for name in sorted(names))


def damaged_model(model_id: str, damage: Damage | str) -> AlloyError:
    """The one error of a model whose files cannot be used (merge, evaluation and evolution alike): it names the
    model and the file, never a server path."""
    reason = damage.describe() if isinstance(damage, Damage) else damage
    details: dict[str, object] = {"model_id": model_id, "damaged": True, "reason": reason}
    if isinstance(damage, Damage):
        details["file"] = damage.file
    return AlloyError(
        ErrorCode.VALIDATION_FAILED,
        f"model {model_id!r} is damaged: {reason}; it is refused until it is registered again "
        f"(DELETE /models/{model_id}, then POST /models)",
        details,
    )
