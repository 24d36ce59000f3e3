"""The model registry: Hugging Face-layout folders described from ``config.json`` and the safetensors headers
(never a weight load, never an unpickle) and stored through the ArtifactStore under ``models/<id>/``."""

from __future__ import annotations

import os
import shutil
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel
from sqlalchemy import func, or_, select
from sqlalchemy.exc import IntegrityError

from alloy.errors import AlloyError, ErrorCode, model_not_found, validation_failed
from alloy.ids import confined_path
from alloy.model_manifest import PICKLE_SUFFIXES, ModelManifest, read_manifest
from alloy.registry.ids import check_id, namespace_clashes
from alloy.storage.artifact_catalog import ArtifactCatalog
from alloy.storage.artifacts import ArtifactStore
from alloy.storage.db import Database, Page
from alloy.storage.db.models import ModelRow
from alloy.storage.db.page import check_paging
from alloy.storage.db.types import utcnow

if TYPE_CHECKING:
    from alloy.config import Settings

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

    @classmethod
    def from_row(cls, row: ModelRow) -> ModelRecord:
        return cls.model_validate(row, from_attributes=True)


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
        manifest: ModelManifest | None = None,
    ) -> ModelRecord:
        """Register a folder (inside the model roots or the data dir) or an artifact folder (URI or key of this
        store). A local folder is copied into the store under ``models/<id>/`` unless ``copy_into_store`` is
        False, in which case the registry points at it in place. ``manifest``: an artifact folder's manifest as
        its publisher read it from the headers it wrote (a fanned-out merge), so that it is not downloaded."""
        check_id("model", model_id)
        self._refuse_taken(model_id)
        artifact_key = self._artifact_key(source)
        source_path: Path | None = None
        if artifact_key is not None:
            manifest = manifest or read_manifest(self._fetch_artifact(model_id, artifact_key))
            prefix = artifact_key
        else:
            source_path = self._confined_local(source)
            manifest = read_manifest(source_path)  # refuses pickle-only folders: "safetensors only"
            prefix = None
            if copy_into_store:
                prefix = f"{MODELS_PREFIX}/{model_id}"
                # No row exists for this id, so anything under the prefix is a crashed registration's leftover.
                infos = self.store.put_dir(prefix, source_path, files=files_to_copy(source_path), overwrite=True)
                self.catalog.record(infos, kind="model", owner=owner)
                source_path = None
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
        )
        try:
            with self.db.session() as session:
                session.add(row)
        except IntegrityError:
            raise self._already_exists(model_id) from None
        return ModelRecord.from_row(row)

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
        path = confined_path(
            Path(str(source).removeprefix("file://")).expanduser(), self.allowed_roots, kind="model path"
        )
        if not path.is_dir():
            raise validation_failed("model path is not a folder", path=str(source))
        return path

    def _fetch_artifact(self, model_id: str, key: str) -> Path:
        local = self.store.local_path(key)
        if local is not None:
            return local
        return self.store.get_dir(key, self._cache_path(model_id))

    def _cache_path(self, model_id: str) -> Path:
        return self.cache_dir / model_id

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
            total = session.scalar(select(func.count()).select_from(query.subquery()))
            rows = session.scalars(query.order_by(ModelRow.id).offset(offset).limit(limit)).all()
            return Page[ModelRecord](
                items=[ModelRecord.from_row(r) for r in rows], total=total, offset=offset, limit=limit
            )

    def manifest(self, model_id: str) -> ModelManifest:
        with self.db.session() as session:
            return ModelManifest.model_validate(self._row(session, model_id).manifest)

    def local_dir(self, model_id: str) -> Path:
        """A local folder holding the model's files: the folder itself (local store, or registered in place), or
        a verified download from S3 into ``<data_dir>/cache/models/<id>``."""
        record = self.get(model_id)
        if record.source_path is not None:
            return Path(record.source_path)
        local = self.store.local_path(record.artifact_prefix)
        if local is not None:
            return local
        cached = self._cache_path(model_id)
        if not cached.is_dir():  # get_dir publishes by rename: an existing folder is complete
            self.store.get_dir(record.artifact_prefix, cached)
        return cached

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
        shutil.rmtree(self._cache_path(model_id), ignore_errors=True)
