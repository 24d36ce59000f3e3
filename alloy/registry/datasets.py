"""The dataset registry: Parquet or JSON Lines files, one per named split, read with pyarrow and stored through
the ArtifactStore as Parquet under ``datasets/<id>/<split>.parquet`` (published atomically as one folder)."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.json as pa_json
import pyarrow.parquet as pq
from pydantic import BaseModel, ConfigDict, ValidationError
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError

from alloy.errors import AlloyError, ErrorCode, from_validation_error, not_found, validation_failed
from alloy.ids import SPLIT_PATTERN, expand_home, outside_roots
from alloy.registry.ids import check_id
from alloy.storage.artifact_catalog import ArtifactCatalog
from alloy.storage.artifacts import ArtifactStore
from alloy.storage.db import Database, Page
from alloy.storage.db.models import DatasetRow
from alloy.storage.db.page import check_paging, count_rows
from alloy.storage.db.types import utcnow

DATASETS_PREFIX = "datasets"
DEFAULT_SPLIT = "train"  # the split name of a dataset registered from a single file
PARQUET_SUFFIXES = (".parquet", ".pq")
JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")


class DatasetTask(BaseModel):
    """What the dataset is for; the evaluation engine interprets it. Extra keys are kept."""

    model_config = ConfigDict(extra="allow")
    type: str
    text_field: str | None = None
    label_field: str | None = None
    labels: list[Any] | None = None


class SplitInfo(BaseModel):
    rows: int
    key: str
    size: int
    sha256: str | None
    source_format: str


class DatasetRecord(BaseModel):
    id: str
    description: str | None
    task: dict[str, Any] | None
    schema_fields: dict[str, str]
    splits: dict[str, SplitInfo]
    row_count: int
    artifact_prefix: str
    owner: str | None
    created_at: datetime

    @classmethod
    def from_row(cls, row: DatasetRow) -> DatasetRecord:
        return cls.model_validate(row, from_attributes=True)


def read_table(path: Path) -> tuple[pa.Table, str]:
    suffix = path.suffix.lower()
    try:
        if suffix in PARQUET_SUFFIXES:
            return pq.read_table(path), "parquet"
        if suffix in JSONL_SUFFIXES:
            return pa_json.read_json(path), "jsonl"
    except (pa.ArrowInvalid, OSError) as exc:
        raise validation_failed(f"{path.name}: unreadable dataset file: {exc}", path=str(path)) from None
    raise validation_failed(f"{path.name}: datasets must be Parquet or JSON Lines files", path=str(path))


def _schema_fields(table: pa.Table) -> dict[str, str]:
    return {field.name: str(field.type) for field in table.schema}


class DatasetRegistry:
    def __init__(self, db: Database, store: ArtifactStore, *, roots: list[Path] | None = None):
        """``roots``: when given, dataset files must lie inside one of these folders."""
        self.db, self.store = db, store
        self.catalog = ArtifactCatalog(db, store)
        self.roots = None if roots is None else [Path(r).resolve() for r in roots]

    def register(
        self,
        dataset_id: str,
        source: str | os.PathLike | Mapping[str, str | os.PathLike] | None = None,
        *,
        splits: Mapping[str, str | os.PathLike] | None = None,
        task: dict[str, Any] | None = None,
        description: str | None = None,
        owner: str | None = None,
    ) -> DatasetRecord:
        """``source``: one file (split ``train``) or a mapping split -> file (``splits=`` is the same mapping)."""
        check_id("dataset", dataset_id)
        files = self._split_files(source, splits)
        if self.exists(dataset_id):
            raise self._already_exists(dataset_id)
        tables = {name: read_table(path) for name, path in files.items()}
        schema = _schema_fields(next(iter(tables.values()))[0])
        checked_task = self._check_task(task, {name: t for name, (t, _) in tables.items()})
        prefix = f"{DATASETS_PREFIX}/{dataset_id}"
        with tempfile.TemporaryDirectory(prefix="alloy-dataset-") as scratch:
            for name, (table, _) in tables.items():
                pq.write_table(table, Path(scratch) / f"{name}.parquet")
            # Never over a published folder: one without a record is an unfinished registration's, which the
            # next start's consistency check removes.
            infos = {i.key: i for i in self.store.put_dir(prefix, scratch)}
        self.catalog.record(infos.values(), kind="dataset", owner=owner)
        split_infos = {}
        for name, (table, source_format) in tables.items():
            info = infos[f"{prefix}/{name}.parquet"]
            split_infos[name] = SplitInfo(
                rows=table.num_rows, key=info.key, size=info.size, sha256=info.sha256, source_format=source_format
            ).model_dump()
        row = DatasetRow(
            id=dataset_id,
            description=description,
            task=checked_task,
            schema_fields=schema,
            splits=split_infos,
            row_count=sum(t.num_rows for t, _ in tables.values()),
            artifact_prefix=prefix,
            owner=owner,
            created_at=utcnow(),
        )
        try:
            with self.db.session() as session:
                session.add(row)
        except BaseException as exc:
            self.store.delete_prefix(prefix)  # nothing may stay published without its record
            self.catalog.forget_prefix(prefix)
            if isinstance(exc, IntegrityError):
                raise self._already_exists(dataset_id) from None
            raise
        return DatasetRecord.from_row(row)

    @staticmethod
    def _already_exists(dataset_id: str) -> AlloyError:
        return AlloyError(
            ErrorCode.ALREADY_EXISTS, f"dataset {dataset_id!r} already exists", {"dataset_id": dataset_id}
        )

    def _split_files(self, source, splits) -> dict[str, Path]:
        if isinstance(source, Mapping):
            splits, source = source, None
        if (source is None) == (splits is None):
            raise validation_failed("give either one dataset file or a mapping of split name -> file")
        mapping = {DEFAULT_SPLIT: source} if source is not None else dict(splits)
        if not mapping:
            raise validation_failed("a dataset needs at least one split")
        files = {}
        for name, path in mapping.items():
            if not isinstance(name, str) or not SPLIT_PATTERN.fullmatch(name):
                raise validation_failed(f"invalid split name {name!r}", split=name)
            resolved = expand_home(path).resolve()
            if self.roots is not None and not any(r == resolved or r in resolved.parents for r in self.roots):
                raise outside_roots("dataset file", self.roots)
            if not resolved.is_file():
                raise validation_failed("dataset file does not exist", path=str(path), split=name)
            files[name] = resolved
        return files

    @staticmethod
    def _check_task(task: dict[str, Any] | None, tables: dict[str, pa.Table]) -> dict[str, Any] | None:
        if task is None:
            return None
        try:
            parsed = DatasetTask.model_validate(task)
        except ValidationError as exc:
            raise from_validation_error(exc, "invalid dataset task", task=task) from None
        if parsed.type == "classification" and not parsed.label_field:
            raise validation_failed("a classification task needs label_field", task=task)
        for role in ("text_field", "label_field"):
            column = getattr(parsed, role)
            missing = [name for name, table in tables.items() if column and column not in table.column_names]
            if missing:
                raise validation_failed(
                    f"task {role} {column!r} is not a column of split(s) {missing}", field=column, splits=missing
                )
        return parsed.model_dump(exclude_none=True)

    # -- reads ----------------------------------------------------------------------------------------------
    def _row(self, session, dataset_id: str) -> DatasetRow:
        row = session.get(DatasetRow, dataset_id)
        if row is None:
            raise not_found("dataset", dataset_id)
        return row

    def get(self, dataset_id: str) -> DatasetRecord:
        with self.db.session() as session:
            return DatasetRecord.from_row(self._row(session, dataset_id))

    def exists(self, dataset_id: str) -> bool:
        with self.db.session() as session:
            return session.get(DatasetRow, dataset_id) is not None

    def list(self, offset: int = 0, limit: int = 50, *, owner: str | None = None) -> Page[DatasetRecord]:
        check_paging(offset, limit)
        query = select(DatasetRow)
        if owner is not None:
            query = query.where(DatasetRow.owner == owner)
        with self.db.session() as session:
            total = count_rows(session, query)
            rows = session.scalars(query.order_by(DatasetRow.id).offset(offset).limit(limit)).all()
            return Page[DatasetRecord](
                items=[DatasetRecord.from_row(r) for r in rows], total=total, offset=offset, limit=limit
            )

    def read_split(self, dataset_id: str, split: str) -> pa.Table:
        record = self.get(dataset_id)
        info = record.splits.get(split)
        if info is None:
            raise AlloyError(
                ErrorCode.NOT_FOUND,
                f"dataset {dataset_id!r} has no split {split!r}",
                {"dataset": dataset_id, "split": split, "splits": sorted(record.splits)},
            )
        with self.store.open(info.key) as handle:
            return pq.read_table(handle)

    def delete(self, dataset_id: str) -> None:
        with self.db.session() as session:
            row = self._row(session, dataset_id)
            prefix = row.artifact_prefix
            session.delete(row)
        self.store.delete_prefix(prefix)
        self.catalog.forget_prefix(prefix)
