"""The ``artifacts`` table: what the artifact store holds (key, uri, size, sha256), by whom and of which kind."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime

from sqlalchemy import delete, select

from alloy.errors import not_found
from alloy.storage.artifacts import ArtifactInfo, ArtifactStore
from alloy.storage.db import Database, Page
from alloy.storage.db.models import ArtifactRow
from alloy.storage.db.page import check_paging, count_rows, rows_changed
from alloy.storage.db.types import utcnow


class ArtifactRecord(ArtifactInfo):
    kind: str | None
    owner: str | None
    created_at: datetime


class ArtifactCatalog:
    """The ``artifacts`` table: what the store holds, by whom and of which kind."""

    def __init__(self, db: Database, store: ArtifactStore):
        self.db, self.store = db, store

    def record(
        self, infos: ArtifactInfo | Iterable[ArtifactInfo], *, kind: str | None = None, owner: str | None = None
    ) -> None:
        infos = [infos] if isinstance(infos, ArtifactInfo) else list(infos)
        with self.db.session() as session:
            for info in infos:
                session.merge(
                    ArtifactRow(
                        key=info.key,
                        uri=info.uri,
                        size=info.size,
                        sha256=info.sha256,
                        kind=kind,
                        owner=owner,
                        created_at=utcnow(),
                    )
                )

    def get(self, key: str) -> ArtifactRecord:
        with self.db.session() as session:
            row = session.get(ArtifactRow, key)
            if row is None:
                raise not_found("artifact", key)
            return self._record(row)

    def list(
        self, prefix: str = "", *, kind: str | None = None, owner: str | None = None, offset: int = 0, limit: int = 50
    ) -> Page[ArtifactRecord]:
        check_paging(offset, limit)
        query = select(ArtifactRow)
        if prefix:
            query = query.where(ArtifactRow.key.startswith(prefix, autoescape=True))
        if kind is not None:
            query = query.where(ArtifactRow.kind == kind)
        if owner is not None:
            query = query.where(ArtifactRow.owner == owner)
        with self.db.session() as session:
            total = count_rows(session, query)
            rows = session.scalars(query.order_by(ArtifactRow.key).offset(offset).limit(limit)).all()
            return Page[ArtifactRecord](items=[self._record(r) for r in rows], total=total, offset=offset, limit=limit)

    def forget_prefix(self, prefix: str) -> int:
        with self.db.session() as session:
            return rows_changed(
                session,
                delete(ArtifactRow).where(ArtifactRow.key.startswith(prefix.rstrip("/") + "/", autoescape=True)),
            )

    def delete(self, key: str) -> None:
        self.store.delete(key)
        with self.db.session() as session:
            session.execute(delete(ArtifactRow).where(ArtifactRow.key == key))

    @staticmethod
    def _record(row: ArtifactRow) -> ArtifactRecord:
        return ArtifactRecord(
            key=row.key,
            uri=row.uri,
            size=row.size,
            sha256=row.sha256,
            kind=row.kind,
            owner=row.owner,
            created_at=row.created_at,
        )
