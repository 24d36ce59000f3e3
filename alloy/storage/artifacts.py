"""The artifact store: binaries (model shards, datasets, merge outputs) on fsspec, either a local folder or
``s3://bucket/prefix`` through s3fs.

Publishing is atomic. A single object is streamed to a hidden staging key and then moved into place (a rename
locally; on S3 an object only appears once its upload completes). A folder (``put_dir``) is staged as a whole and
then published: locally with one directory rename, after every file and folder of the staging area was
fsynced (and the parent folder after the rename), so that a power loss after the catalogue commit never finds a
record whose files are empty or missing; on S3, where folders cannot be renamed, files are copied next
to a ``.alloy-pending`` marker that hides them until the directory manifest (``.alloy-dir.json``, with every
file's size and sha256) is written and the marker removed. A crash at any point leaves nothing visible.

:mod:`alloy.storage.artifact_catalog` records what was published in the ``artifacts`` table.
"""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
import shutil
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from alloy.errors import AlloyError, ErrorCode, not_found, validation_failed
from alloy.storage.artifact_keys import (
    DIR_MANIFEST,
    PENDING_MARKER,
    RESERVED_NAMES,
    STAGING,
    ArtifactInfo,
    CorruptArtifact,
    check_key,
    staging_tag,
)
from alloy.storage.durable import fsync_dir, fsync_tree, write_file

if TYPE_CHECKING:
    from alloy.config import Settings

DEFAULT_CHUNK_BYTES = 8 * 1024 * 1024

__all__ = ["DIR_MANIFEST", "PENDING_MARKER", "STAGING", "ArtifactInfo", "ArtifactStore", "CorruptArtifact", "check_key"]


def _chunks_of(handle: IO[bytes], chunk_bytes: int) -> Iterator[bytes]:
    while chunk := handle.read(chunk_bytes):
        yield chunk


class ArtifactStore:
    def __init__(
        self,
        uri: str | os.PathLike,
        storage_options: dict[str, Any] | None = None,
        *,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    ):
        options = dict(storage_options or {})
        uri = str(uri)
        if uri.startswith("s3://"):
            # Several processes write the same bucket: never trust a cached listing.
            options.setdefault("use_listings_cache", False)
        self.fs, root = fsspec.core.url_to_fs(uri, **options)
        self.is_local = isinstance(self.fs, LocalFileSystem)
        self.root = root.rstrip("/")
        self.chunk_bytes = chunk_bytes
        if self.is_local:
            self.fs.makedirs(self.root, exist_ok=True)
            self.uri = self.root
        else:
            protocol = self.fs.protocol if isinstance(self.fs.protocol, str) else self.fs.protocol[0]
            self.uri = f"{protocol}://{self.root}"

    @classmethod
    def from_settings(cls, settings: Settings) -> ArtifactStore:
        return cls(settings.artifacts_uri, settings.storage_options, chunk_bytes=settings.artifacts.chunk_bytes)

    def __repr__(self) -> str:
        return f"ArtifactStore({self.uri!r})"

    # -- addressing -----------------------------------------------------------------------------------------
    def _path(self, key: str) -> str:
        key = check_key(key, allow_root=True)
        return f"{self.root}/{key}" if key else self.root

    def _key_of(self, path: str) -> str:
        return self.fs._strip_protocol(path)[len(self.root) + 1 :]

    def uri_for(self, key: str) -> str:
        key = check_key(key)
        return f"{self.uri}/{key}"

    def key_for(self, uri: str) -> str | None:
        """The key of a URI (or local path) inside this store, or None when it points elsewhere."""
        uri = str(uri).rstrip("/")
        if self.is_local:
            uri = uri.removeprefix("file://")
            if not os.path.isabs(uri):
                return None
            uri = os.path.realpath(uri)
            root = os.path.realpath(self.root)
        else:
            root = self.uri
        if uri.startswith(root + "/"):
            return check_key(uri[len(root) + 1 :])
        return None

    def local_path(self, key: str) -> Path | None:
        """The file or folder of a key on disk, for a local store; None for remote stores."""
        return Path(self._path(key)) if self.is_local else None

    def _staging_path(self, prefix: str | None = None) -> str:
        return self._staged(self.new_staging(prefix))

    # -- writes ---------------------------------------------------------------------------------------------
    def _write(self, path: str, chunks: Iterable[bytes]) -> tuple[int, str]:
        digest, size = hashlib.sha256(), 0
        if self.is_local:
            self.fs.makedirs(posixpath.dirname(path), exist_ok=True)
        if self.is_local:  # fsynced: the rename that publishes it must never outrun its bytes
            return write_file(path, chunks)
        with self.fs.open(path, "wb") as handle:
            for chunk in chunks:
                handle.write(chunk)
                digest.update(chunk)
                size += len(chunk)
        return size, digest.hexdigest()

    def _discard(self, path: str) -> None:
        try:
            if self.fs.exists(path):
                self.fs.rm(path, recursive=True)
        except OSError:  # best effort: gc_staging() sweeps what is left
            pass

    def put_stream(self, key: str, chunks: Iterable[bytes]) -> ArtifactInfo:
        """Stream bytes into ``key``; it becomes visible only once complete (replacing any old value)."""
        final = self._path(check_key(key))
        staging = self._staging_path()
        try:
            size, sha256 = self._write(staging, chunks)
            if self.is_local:
                self.fs.makedirs(posixpath.dirname(final), exist_ok=True)
            self.fs.mv(staging, final)
            if self.is_local:
                fsync_dir(posixpath.dirname(final))
        except BaseException:
            self._discard(staging)
            raise
        return ArtifactInfo(key=key, uri=self.uri_for(key), size=size, sha256=sha256)

    def put_file(self, key: str, path: str | os.PathLike) -> ArtifactInfo:
        with open(path, "rb") as handle:
            return self.put_stream(key, _chunks_of(handle, self.chunk_bytes))

    def put_bytes(self, key: str, data: bytes) -> ArtifactInfo:
        return self.put_stream(key, [data])

    def put_dir(
        self, prefix: str, local_dir: str | os.PathLike, *, files: Iterable[str] | None = None, overwrite: bool = False
    ) -> list[ArtifactInfo]:
        """Publish a folder (or the given relative ``files`` of it) under ``prefix``, atomically as a whole.
        An existing folder is refused with ALREADY_EXISTS unless ``overwrite``."""
        self._clear_target(prefix, overwrite)  # refuse before uploading anything
        local_dir = Path(local_dir)
        if not local_dir.is_dir():
            raise validation_failed("not a folder", path=str(local_dir))
        names = (
            sorted(files)
            if files is not None
            else sorted(p.relative_to(local_dir).as_posix() for p in local_dir.rglob("*") if p.is_file())
        )
        staging_id = self.new_staging(prefix)
        try:
            entries = [self.stage_file(staging_id, name, local_dir / name) for name in names]
            return self.publish_staged(staging_id, prefix, entries, overwrite=overwrite)
        except BaseException:
            self.discard_staged(staging_id)
            raise

    # A folder assembled by several writers (the groups of a fanned-out merge, on any node): each stages its
    # files under one staging id, and one of them publishes the lot with the same atomic publish as put_dir.
    def new_staging(self, prefix: str | None = None) -> str:
        """A fresh staging id; named after the ``prefix`` it will publish, so that the leftovers of one writer
        can be found and removed (:meth:`discard_staging`)."""
        tag = f"{staging_tag(check_key(prefix))}." if prefix else ""
        return f"{tag}{uuid.uuid4().hex}"

    def _staged(self, staging_id: str, name: str = "") -> str:
        if not staging_id or "/" in staging_id or staging_id.startswith("."):
            raise validation_failed("invalid staging id")
        return f"{self.root}/{STAGING}/{staging_id}" + (f"/{check_key(name)}" if name else "")

    def stage_file(self, staging_id: str, name: str, path: str | os.PathLike) -> dict[str, Any]:
        """Upload one file into a staging folder (hidden); returns its manifest entry (name, size, sha256)."""
        with open(path, "rb") as handle:
            size, sha256 = self._write(self._staged(staging_id, name), _chunks_of(handle, self.chunk_bytes))
        return {"name": name, "size": size, "sha256": sha256}

    def publish_staged(
        self, staging_id: str, prefix: str, entries: list[dict[str, Any]], *, overwrite: bool = False
    ) -> list[ArtifactInfo]:
        """Publish the staged ``entries`` (as :meth:`stage_file` returned them) under ``prefix``, atomically."""
        final = self._clear_target(prefix, overwrite)
        staging = self._staged(staging_id)
        entries = sorted(entries, key=lambda e: e["name"])
        manifest = json.dumps({"files": entries, "created_at": datetime.now(timezone.utc).isoformat()}).encode()
        self._write(f"{staging}/{DIR_MANIFEST}", [manifest])
        self._publish_dir(staging, final, [e["name"] for e in entries])
        return [self._entry_info(check_key(prefix), e) for e in entries]

    def _clear_target(self, prefix: str, overwrite: bool) -> str:
        prefix = check_key(prefix)
        final = self._path(prefix)
        if self.fs.exists(final):
            if not overwrite:
                raise AlloyError(
                    ErrorCode.ALREADY_EXISTS, f"artifact folder {prefix!r} already exists", {"prefix": prefix}
                )
            self.delete_prefix(prefix)
        return final

    def _entry_info(self, prefix: str, entry: dict[str, Any]) -> ArtifactInfo:
        key = f"{prefix}/{entry['name']}"
        return ArtifactInfo(key=key, uri=self.uri_for(key), size=entry["size"], sha256=entry["sha256"])

    def discard_staged(self, staging_id: str) -> None:
        self._discard(self._staged(staging_id))

    def _publish_dir(self, staging: str, final: str, names: list[str]) -> None:
        if self.is_local:
            fsync_tree(staging)  # the entries of every staged folder are durable before the rename
            parent = posixpath.dirname(final)
            self.fs.makedirs(parent, exist_ok=True)
            os.rename(staging, final)  # atomic on one filesystem; fails rather than merging into a folder
            fsync_dir(parent)  # the rename itself is durable before the caller commits the catalogue
            return
        self._write(f"{final}/{PENDING_MARKER}", [b""])
        for name in names:
            self.fs.copy(f"{staging}/{name}", f"{final}/{name}")
        self.fs.copy(f"{staging}/{DIR_MANIFEST}", f"{final}/{DIR_MANIFEST}")
        self.fs.rm(f"{final}/{PENDING_MARKER}")
        self.fs.rm(staging, recursive=True)

    # -- reads ----------------------------------------------------------------------------------------------
    def _hidden_by_pending(self, key: str) -> bool:
        if self.is_local:
            return False  # local folders are published by rename: never half-visible
        parts = key.split("/")
        return any(self.fs.exists(f"{self.root}/{'/'.join(parts[:i])}/{PENDING_MARKER}") for i in range(1, len(parts)))

    def exists(self, key: str) -> bool:
        """A published object, or a published folder."""
        path = self._path(check_key(key))
        if self.fs.isfile(path):
            return not self._hidden_by_pending(key)
        return self.dir_exists(key)

    def dir_exists(self, prefix: str) -> bool:
        return self.fs.isfile(f"{self._path(check_key(prefix))}/{DIR_MANIFEST}")

    def info(self, key: str) -> ArtifactInfo:
        path = self._path(check_key(key))
        if not self.fs.isfile(path) or self._hidden_by_pending(key):
            raise not_found("artifact", key)
        return ArtifactInfo(key=key, uri=self.uri_for(key), size=self.fs.size(path))

    def open(self, key: str) -> IO[bytes]:
        """A binary read stream (the caller closes it)."""
        self.info(key)
        return self.fs.open(self._path(key), "rb")

    def iter_bytes(self, key: str, chunk_size: int | None = None) -> Iterator[bytes]:
        handle = self.open(key)

        def stream() -> Iterator[bytes]:
            with handle:
                yield from _chunks_of(handle, chunk_size or self.chunk_bytes)

        return stream()

    def read_bytes(self, key: str) -> bytes:
        with self.open(key) as handle:
            return handle.read()

    def dir_manifest(self, prefix: str) -> list[ArtifactInfo]:
        """The files of a published folder, with their sizes and hashes."""
        prefix = check_key(prefix)
        try:
            with self.fs.open(f"{self._path(prefix)}/{DIR_MANIFEST}", "rb") as handle:
                manifest = json.load(handle)
        except FileNotFoundError:
            raise not_found("artifact folder", prefix) from None
        return [self._entry_info(prefix, e) for e in manifest["files"]]

    def list(self, prefix: str = "") -> list[ArtifactInfo]:
        """Published objects under ``prefix``, sorted by key (staging areas and half-published folders hidden)."""
        base = self._path(prefix)
        if not self.fs.exists(base):
            return []
        found = self.fs.find(base, detail=True)
        keys = {self._key_of(path): entry["size"] for path, entry in found.items() if entry["type"] == "file"}
        pending = [k[: -len(PENDING_MARKER)] for k in keys if posixpath.basename(k) == PENDING_MARKER]
        hashes: dict[str, str | None] = {}
        for key in keys:
            if posixpath.basename(key) == DIR_MANIFEST:
                folder = posixpath.dirname(key)
                hashes.update({i.key: i.sha256 for i in self.dir_manifest(folder)} if folder else {})
        return [
            ArtifactInfo(key=key, uri=self.uri_for(key), size=size, sha256=hashes.get(key))
            for key, size in sorted(keys.items())
            if not key.startswith(STAGING + "/")
            and posixpath.basename(key) not in RESERVED_NAMES
            and not any(key.startswith(p) for p in pending)
        ]

    def get_dir(self, prefix: str, dest: str | os.PathLike, include: Callable[[str], bool] | None = None) -> Path:
        """Download a published folder (or its files whose names ``include`` accepts) into ``dest`` (replaced
        atomically), verifying every sha256."""
        files = [f for f in self.dir_manifest(prefix) if include is None or include(f.key[len(prefix) + 1 :])]
        dest = Path(dest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        partial = dest.parent / f".{dest.name}.partial-{uuid.uuid4().hex[:8]}"
        try:
            for info in files:
                target = partial / info.key[len(prefix) + 1 :]
                target.parent.mkdir(parents=True, exist_ok=True)
                digest = hashlib.sha256()
                with self.fs.open(self._path(info.key), "rb") as source, open(target, "wb") as sink:
                    for chunk in _chunks_of(source, self.chunk_bytes):
                        digest.update(chunk)
                        sink.write(chunk)
                if digest.hexdigest() != info.sha256:
                    raise CorruptArtifact(info.key)
            if dest.exists():
                shutil.rmtree(dest)
            os.rename(partial, dest)
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise
        return dest

    # -- deletes --------------------------------------------------------------------------------------------
    def delete(self, key: str) -> bool:
        path = self._path(check_key(key))
        if not self.fs.isfile(path):
            return False
        self.fs.rm(path)
        return True

    def delete_prefix(self, prefix: str) -> int:
        """Delete everything under ``prefix``; a published folder loses its manifest first, so readers stop
        treating it as complete before its files go."""
        base = self._path(check_key(prefix))
        if not self.fs.exists(base):
            return 0
        if self.fs.isfile(f"{base}/{DIR_MANIFEST}"):
            self.fs.rm(f"{base}/{DIR_MANIFEST}")
        count = len(self.fs.find(base))
        self.fs.rm(base, recursive=True)
        return count

    def discard_staging(self, prefix: str) -> int:
        """Remove the staging leftovers of writes to ``prefix`` (a writer killed while it copied); returns how
        many. Only for a prefix no live writer is publishing (e.g. the output of a job whose run was lost)."""
        base = f"{self.root}/{STAGING}"
        if not self.fs.exists(base):
            return 0
        tag = staging_tag(check_key(prefix))
        removed = 0
        for path in self.fs.ls(base, detail=False):
            name = posixpath.basename(str(path).rstrip("/"))
            if name.rsplit(".", 1)[0] == tag:
                self._discard(str(path))
                removed += 1
        return removed

    def gc_staging(self, older_than_s: float = 3600.0) -> int:
        """Remove staging leftovers of crashed writers (older than ``older_than_s``)."""
        base = f"{self.root}/{STAGING}"
        if not self.fs.exists(base):
            return 0
        removed, cutoff = 0, time.time() - older_than_s
        for entry in self.fs.ls(base, detail=True):
            modified = entry.get("mtime") or entry.get("LastModified") or entry.get("created")
            if isinstance(modified, datetime):
                modified = modified.timestamp()
            if modified is None or modified < cutoff:
                self.fs.rm(entry["name"], recursive=True)
                removed += 1
        return removed
