"""The model registry: Hugging Face-layout folders described from ``config.json`` and the safetensors headers
(never a weight load, never an unpickle) and stored through the ArtifactStore under ``models/<id>/``.

Integrity: each file's size and sha256 is recorded at registration (hashed while it is copied into the store,
or read in place) and :meth:`ModelRegistry.local_dir`, the one way every engine gets a model's files, verifies
the folder against it (once per process and file version, :class:`alloy.storage.integrity.FileVerifier`). A
damaged model is marked ``broken`` (as the start-up consistency check marks one) and refused as an input, by
``local_dir`` and ``manifest`` alike, until it is registered again."""

from __future__ import annotations

import builtins
import logging
import os
import shutil
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from filelock import FileLock
from pydantic import BaseModel, computed_field
from sqlalchemy import or_, select
from sqlalchemy.exc import IntegrityError

from alloy.errors import AlloyError, ErrorCode, model_not_found, validation_failed
from alloy.ids import confined_path, expand_home
from alloy.model_manifest import PICKLE_SUFFIXES, ModelManifest
from alloy.registry.adapters import ADAPTER_MODEL_TYPE, Kind, read_entry_manifest
from alloy.registry.ids import check_id, namespace_clashes
from alloy.storage.artifact_catalog import ArtifactCatalog
from alloy.storage.artifacts import ArtifactStore, CorruptArtifact
from alloy.storage.db import Database, Page
from alloy.storage.db.models import ModelRow
from alloy.storage.db.page import check_paging, count_rows
from alloy.storage.db.types import utcnow
from alloy.storage.integrity import Damage, FileRecord, FileVerifier, damaged_model, digest_files

if TYPE_CHECKING:
    from alloy.config import Settings

logger = logging.getLogger(__name__)

MODELS_PREFIX = "models"
# What a model folder may carry into the store: weights, configs, tokenizers, chat templates, the model card.
COPIED_SUFFIXES = frozenset({".safetensors", ".json", ".model", ".txt", ".tiktoken", ".jinja", ".md"})


class ModelRecord(BaseModel):
    id: str
    architecture: str | None
    model_type: str | None
    dtypes: list[str]
    parameter_count: int
    num_layers: int | None
    hidden_size: int | None
    fingerprint: str
    shards: list[str]
    tensor_count: int
    size_bytes: int
    artifact_prefix: str | None
    source_path: str | None
    owner: str | None
    lineage: dict[str, Any] | None
    created_at: datetime
    broken: str | None = None  # why the model is refused as an input (damaged or missing files); None: usable

    @classmethod
    def from_row(cls, row: ModelRow) -> ModelRecord:
        return cls.model_validate(row, from_attributes=True)

    @computed_field  # type: ignore[prop-decorator]
    @property
    def kind(self) -> Kind:
        """``adapter`` for a PEFT LoRA adapter (merged as ``base-id+adapter-id``), else ``model``."""
        return "adapter" if self.model_type == ADAPTER_MODEL_TYPE else "model"


def files_to_copy(model_dir: Path) -> list[str]:
    return sorted(
        p.name
        for p in model_dir.iterdir()
        if p.is_file()
        and p.suffix in COPIED_SUFFIXES
        and p.suffix not in PICKLE_SUFFIXES
        and not p.name.startswith(".")
    )


class ModelRegistry:
    def __init__(
        self,
        db: Database,
        store: ArtifactStore,
        *,
        model_roots: list[Path] | tuple = (),
        data_dir: str | os.PathLike = "var",
    ):
        self.db, self.store = db, store
        self.catalog = ArtifactCatalog(db, store)
        self.data_dir = Path(data_dir).resolve()
        self.allowed_roots = [Path(root).resolve() for root in model_roots] + [self.data_dir]
        self.cache_dir = self.data_dir / "cache" / "models"
        self.verifier = FileVerifier()

    @classmethod
    def from_settings(cls, settings: Settings, db: Database, store: ArtifactStore) -> ModelRegistry:
        return cls(db, store, model_roots=settings.model_roots, data_dir=settings.data_dir)

    # -- register -------------------------------------------------------------------------------------------
    def register(
        self,
        model_id: str,
        source: str | os.PathLike,
        *,
        owner: str | None = None,
        lineage: dict[str, Any] | None = None,
        copy_into_store: bool = True,
        kind: Kind | None = None,
        manifest: ModelManifest | None = None,
    ) -> ModelRecord:
        """Register a folder (inside the model roots or the data dir) or an artifact folder (URI or key of this
        store). A local folder is copied into the store under ``models/<id>/`` unless ``copy_into_store`` is
        False, in which case the registry points at it in place. ``kind``: ``model`` or ``adapter`` (a PEFT LoRA
        adapter, :mod:`alloy.registry.adapters`); None: an ``adapter_config.json`` folder is an adapter.
        ``manifest``: an artifact folder's manifest as its publisher read it from the headers it wrote (a
        fanned-out merge), so that it is not downloaded."""
        check_id("model", model_id)
        self._refuse_taken(model_id)
        artifact_key = self._artifact_key(source)
        source_path: Path | None = None
        published: str | None = None  # the folder this registration published (removed again if it fails)
        if artifact_key is not None:
            manifest = manifest or read_entry_manifest(self._fetch_artifact(model_id, artifact_key), model_id, kind)
            prefix = artifact_key
            files = {
                info.key[len(prefix) + 1 :]: FileRecord(size=info.size, sha256=info.sha256 or "")
                for info in self.store.dir_manifest(prefix)
            }
        else:
            source_path = self._confined_local(source)
            manifest = read_entry_manifest(source_path, model_id, kind)  # refuses pickles: "safetensors only"
            names = files_to_copy(source_path)
            prefix = None
            if copy_into_store:
                prefix = published = f"{MODELS_PREFIX}/{model_id}"
                infos = self._publish(model_id, prefix, source_path, names)  # hashed while copied
                self.catalog.record(infos, kind="model", owner=owner)
                files = {info.key[len(prefix) + 1 :]: FileRecord(size=info.size, sha256=info.sha256) for info in infos}
                source_path = None
            else:
                files = digest_files(source_path, names)  # registered in place: hashed once, here
        row = ModelRow(
            id=model_id,
            architecture=manifest.architecture,
            model_type=manifest.model_type,
            dtypes=manifest.dtypes,
            parameter_count=manifest.parameter_count,
            num_layers=manifest.num_layers,
            hidden_size=manifest.hidden_size,
            fingerprint=manifest.fingerprint,
            shards=manifest.shards,
            tensor_count=len(manifest.tensors),
            size_bytes=manifest.size_bytes,
            artifact_prefix=prefix,
            source_path=str(source_path) if source_path else None,
            manifest=manifest.model_dump(mode="json"),
            owner=owner,
            lineage=lineage,
            created_at=utcnow(),
            files={name: record.model_dump() for name, record in files.items()},
            broken=None,
        )
        try:
            with self.db.session() as session:
                session.add(row)
        except BaseException as exc:
            if published is not None:  # nothing may stay published without its record
                self.store.delete_prefix(published)
                self.catalog.forget_prefix(published)
            if isinstance(exc, IntegrityError):
                raise self._already_exists(model_id) from None
            raise
        return ModelRecord.from_row(row)

    def _publish(self, model_id: str, prefix: str, source: Path, names: list[str]):
        """Copy into the store; never over a published folder (one without a record is an unfinished
        registration's: the next start's consistency check removes it)."""
        try:
            return self.store.put_dir(prefix, source, files=names)
        except AlloyError as exc:
            if exc.code is not ErrorCode.ALREADY_EXISTS:
                raise
            raise AlloyError(
                ErrorCode.ALREADY_EXISTS,
                f"model {model_id!r}: files of an unfinished registration of this id are still in the store; "
                "they are removed at the next start",
                {"model_id": model_id},
            ) from None

    def _already_exists(self, model_id: str) -> AlloyError:
        return AlloyError(ErrorCode.ALREADY_EXISTS, f"model {model_id!r} already exists", {"model_id": model_id})

    def _refuse_taken(self, model_id: str) -> None:
        with self.db.session() as session:
            if session.get(ModelRow, model_id) is not None:
                raise self._already_exists(model_id)
            nested = session.scalar(
                select(ModelRow.id)
                .where(
                    or_(
                        ModelRow.id.in_(namespace_clashes(model_id)),
                        ModelRow.id.startswith(model_id + "/", autoescape=True),
                    )
                )
                .limit(1)
            )
        if nested is not None:
            raise validation_failed(
                f"model id {model_id!r} clashes with the namespace of {nested!r}",
                model_id=model_id,
                clashes_with=nested,
            )

    def _artifact_key(self, source: str | os.PathLike) -> str | None:
        text = str(source)
        key = self.store.key_for(text)
        if key is None and "://" in text and not text.startswith("file://"):
            raise validation_failed("source URI is not inside the artifact store", source=text, store=self.store.uri)
        if key is not None and not self.store.dir_exists(key):
            raise validation_failed("source is not a published artifact folder", source=text)
        return key

    def _confined_local(self, source: str | os.PathLike) -> Path:
        # The error never names the configured roots: clients learn nothing about the server's folders.
        path = confined_path(expand_home(str(source).removeprefix("file://")), self.allowed_roots, kind="model path")
        if not path.is_dir():
            raise validation_failed("model path is not a folder", path=str(source))
        return path

    def _fetch_artifact(self, model_id: str, key: str) -> Path:
        local = self.store.local_path(key)
        if local is not None:
            return local
        return self._download(model_id, key)

    def _cache_path(self, model_id: str) -> Path:
        return self.cache_dir / model_id

    def _download(self, model_id: str, prefix: str, *, only_if_missing: bool = False) -> Path:
        """The model's files from the store into this node's cache (replacing its copy), verifying every sha256;
        ``only_if_missing``: keep a copy already there (get_dir publishes by rename: an existing folder is complete).
        """
        cached = self._cache_path(model_id)
        with self._cache_lock(model_id):
            if not (only_if_missing and cached.is_dir()):
                self.store.get_dir(prefix, cached)
        return cached

    def _cache_lock(self, model_id: str) -> FileLock:
        """The lock of a model's copy in this node's cache, held to download, replace or remove it. WHY: every
        process on the node shares the cache (engine replicas, merge groups); two merges that wanted a model at
        once both downloaded it, and the second replaced the folder the first was already checking."""
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        return FileLock(str(self.cache_dir / f".{model_id.replace('/', '--')}.lock"))

    # -- reads ----------------------------------------------------------------------------------------------
    def _row(self, session, model_id: str) -> ModelRow:
        row = session.get(ModelRow, model_id) if isinstance(model_id, str) else None
        if row is None:
            raise model_not_found(model_id)
        return row

    def get(self, model_id: str) -> ModelRecord:
        with self.db.session() as session:
            return ModelRecord.from_row(self._row(session, model_id))

    def exists(self, model_id: str) -> bool:
        with self.db.session() as session:
            return session.get(ModelRow, model_id) is not None

    def list(self, offset: int = 0, limit: int = 50, *, owner: str | None = None) -> Page[ModelRecord]:
        check_paging(offset, limit)
        query = select(ModelRow)
        if owner is not None:
            query = query.where(ModelRow.owner == owner)
        with self.db.session() as session:
            total = count_rows(session, query)
            rows = session.scalars(query.order_by(ModelRow.id).offset(offset).limit(limit)).all()
            return Page[ModelRecord](
                items=[ModelRecord.from_row(r) for r in rows], total=total, offset=offset, limit=limit
            )

    def manifest(self, model_id: str) -> ModelManifest:
        """The manifest of a model taken as an input (merge and evaluation validation): a broken one is refused."""
        with self.db.session() as session:
            row = self._row(session, model_id)
            if row.broken:
                raise damaged_model(model_id, row.broken)
            return ModelManifest.model_validate(row.manifest)

    def local_dir(self, model_id: str) -> Path:
        """A local folder holding the model's verified files: the folder itself (local store, or registered in
        place), or a verified download from S3 into ``<data_dir>/cache/models/<id>``. A damaged model is marked
        broken and refused (the error names the model and the file)."""
        with self.db.session() as session:
            row = self._row(session, model_id)
            broken, files = row.broken, row.files
            source_path, prefix = row.source_path, row.artifact_prefix
        if broken:
            raise damaged_model(model_id, broken)
        folder = self._folder(model_id, source_path, prefix)
        expected = self._expected_files(model_id, folder, files, prefix)
        damage = self.verifier.check(folder, expected)
        if damage is not None and folder == self._cache_path(model_id):
            # A node's copy is not the model: download it again (verified against the store as it comes). Only a
            # damaged stored file (CorruptArtifact) or a damaged folder registered in place marks the model broken.
            logger.warning("the cached copy of model %s %s: downloading it again", model_id, damage.describe())
            folder = self._folder(model_id, source_path, prefix, replace=True)
            damage = self.verifier.check(folder, expected)
        if damage is not None:
            self.mark_broken(model_id, damage.describe())
            raise damaged_model(model_id, damage)
        return folder

    def _folder(self, model_id: str, source_path: str | None, prefix: str | None, *, replace: bool = False) -> Path:
        if source_path is not None:
            return Path(source_path)
        assert prefix is not None
        local = self.store.local_path(prefix)
        if local is not None:
            return local
        try:
            return self._download(model_id, prefix, only_if_missing=not replace)
        except CorruptArtifact as exc:
            damage = Damage(file=exc.key[len(prefix) + 1 :], reason="does not match its sha256 in the store")
            self.mark_broken(model_id, damage.describe())
            raise damaged_model(model_id, damage) from None

    def _expected_files(
        self, model_id: str, folder: Path, files: dict[str, Any] | None, prefix: str | None
    ) -> dict[str, FileRecord]:
        if files is not None:
            return {name: FileRecord.model_validate(record) for name, record in files.items()}
        if prefix is not None:  # registered before files were recorded: the folder manifest of the store
            return {
                info.key[len(prefix) + 1 :]: FileRecord(size=info.size, sha256=info.sha256 or "")
                for info in self.store.dir_manifest(prefix)
            }
        # Registered in place before files were recorded: trust the files as they are now, once, and record them.
        recorded = digest_files(folder, files_to_copy(folder))
        with self.db.session() as session:
            self._row(session, model_id).files = {name: r.model_dump() for name, r in recorded.items()}
        return recorded

    # -- integrity ------------------------------------------------------------------------------------------
    def verify(self, model_id: str) -> str | None:
        """Why the model's files are not what was registered (every file hashed afresh), or None: the start-up
        consistency check. Marks nothing; see :meth:`set_broken`."""
        with self.db.session() as session:
            row = self._row(session, model_id)
            files, source_path, prefix = row.files, row.source_path, row.artifact_prefix
        folder = Path(source_path) if source_path is not None else self.store.local_path(prefix or "")
        if folder is None or not folder.is_dir():
            return None if folder is None else "the model folder is missing"
        if files is None and source_path is not None:
            return None  # nothing recorded to check against yet (recorded at its first use)
        expected = self._expected_files(model_id, folder, files, prefix)
        damage = self.verifier.check(folder, expected, remember=False)
        return damage.describe() if damage is not None else None

    def mark_broken(self, model_id: str, reason: str) -> None:
        self.set_broken(model_id, reason)

    def set_broken(self, model_id: str, reason: str | None) -> None:
        """Mark the model refused as an input (``reason``) or usable again (None)."""
        with self.db.session() as session:
            row = session.get(ModelRow, model_id)
            if row is not None and row.broken != reason:
                row.broken = reason[:2000] if reason else None

    def discard_unfinished(self, model_id: str, job_id: str) -> builtins.list[str]:
        """Remove what a lost run of job ``job_id`` left of its output ``model_id``: staging leftovers of its
        copy into the store, a published folder without a record (killed between the rename and the commit),
        or the registration itself when that very job made it (killed before COMPLETED). Returns what went."""
        prefix = f"{MODELS_PREFIX}/{model_id}"
        removed = [f"{count} staging folders"] if (count := self.store.discard_staging(prefix)) else []
        with self.db.session() as session:
            row = session.get(ModelRow, model_id)
            registered_by_job = row is not None and (row.lineage or {}).get("job_id") == job_id
            unrecorded = row is None
        if registered_by_job:
            self.delete(model_id)
            removed.append(f"model {model_id}")
        elif unrecorded and self.store.delete_prefix(prefix):
            self.catalog.forget_prefix(prefix)
            removed.append(prefix)
        return removed

    # -- delete ---------------------------------------------------------------------------------------------
    def delete(self, model_id: str) -> None:
        """Unregister; files the registry copied into the store (``models/<id>/``) and cached go too, a folder
        registered in place or another artifact folder is left alone."""
        with self.db.session() as session:
            row = self._row(session, model_id)
            prefix = row.artifact_prefix
            session.delete(row)
        if prefix == f"{MODELS_PREFIX}/{model_id}":
            self.store.delete_prefix(prefix)
            self.catalog.forget_prefix(prefix)
        with self._cache_lock(model_id):
            shutil.rmtree(self._cache_path(model_id), ignore_errors=True)
