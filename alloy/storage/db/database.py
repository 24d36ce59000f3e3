"""The database connection: one SQLAlchemy engine, transactional sessions, Alembic migrations and the
schema-version check done at connect time.

SQLite (the default, a file under ``./var``) is shared by several processes (Ray replicas), so it runs in WAL
mode with a busy timeout. PostgreSQL is used through psycopg 3 (``postgresql+psycopg://``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker

from alloy.errors import AlloyError, ErrorCode

if TYPE_CHECKING:
    from alloy.config import Settings

MIGRATIONS_DIR = Path(__file__).parent / "migrations"
UPGRADE_COMMAND = "alloy db upgrade"
SQLITE_BUSY_TIMEOUT_MS = 30_000


def normalize_url(url: str) -> str:
    """Plain ``postgresql://`` URLs get the psycopg 3 driver (psycopg2 is not a dependency)."""
    for prefix in ("postgresql://", "postgres://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url[len(prefix) :]
    return url


def _enable_sqlite_concurrency(engine: Engine) -> None:
    """WAL, a busy timeout, and every transaction opened with ``BEGIN IMMEDIATE``.

    Why: left to itself, pysqlite runs a session's reads outside any transaction and begins one only at the first
    write, so a read-modify-write (merging a job's progress while a heartbeat merges into the same row) is not
    atomic, and under contention its compare-and-set kept losing until it gave up. A transaction begun deferred at
    the read would not help: WAL answers SQLITE_BUSY at once, without the busy timeout, when it asks for the write
    lock after another writer committed. Taking the write lock at BEGIN makes transactions queue on the busy
    timeout (reads included: each session is short, and PostgreSQL serves heavier concurrency). pysqlite's own
    BEGIN is switched off (``isolation_level = None``) so that SQLAlchemy's begin is the only one (the SQLite
    dialect's documented recipe)."""

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection, _record) -> None:
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute(f"PRAGMA busy_timeout = {SQLITE_BUSY_TIMEOUT_MS}")
        cursor.execute("PRAGMA journal_mode = WAL")
        cursor.execute("PRAGMA foreign_keys = ON")
        cursor.execute("PRAGMA synchronous = NORMAL")  # durable at checkpoints; safe with WAL
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(connection) -> None:
        connection.exec_driver_sql("BEGIN IMMEDIATE")


class Database:
    """An engine plus session factory. ``session()`` commits on success and rolls back on error."""

    def __init__(self, url: str, *, echo: bool = False):
        self.url = normalize_url(url)
        parsed = make_url(self.url)
        self.is_sqlite = parsed.get_backend_name() == "sqlite"
        if self.is_sqlite and parsed.database and parsed.database != ":memory:":
            Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
        connect_args = {"timeout": SQLITE_BUSY_TIMEOUT_MS / 1000} if self.is_sqlite else {}
        self.engine: Engine = create_engine(
            self.url, echo=echo, pool_pre_ping=not self.is_sqlite, connect_args=connect_args
        )
        if self.is_sqlite:
            _enable_sqlite_concurrency(self.engine)
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)

    @classmethod
    def from_settings(cls, settings: Settings) -> Database:
        return cls(settings.database_url, echo=settings.database.echo)

    def __repr__(self) -> str:
        return f"Database({make_url(self.url).render_as_string(hide_password=True)!r})"

    @contextmanager
    def session(self) -> Iterator[Session]:
        session = self._sessions()
        try:
            yield session
            session.commit()
        except BaseException:
            session.rollback()
            raise
        finally:
            session.close()

    # -- schema version -------------------------------------------------------------------------------------
    def alembic_config(self) -> Config:
        config = Config()
        config.set_main_option("script_location", str(MIGRATIONS_DIR))
        config.attributes["engine"] = self.engine
        return config

    def head_revision(self) -> str:
        head = ScriptDirectory.from_config(self.alembic_config()).get_current_head()
        if head is None:  # a packaging error: the migrations are part of the package
            raise RuntimeError(f"no Alembic migrations in {MIGRATIONS_DIR}")
        return head

    def current_revision(self) -> str | None:
        with self.engine.connect() as connection:
            return MigrationContext.configure(connection).get_current_revision()

    def upgrade(self, revision: str = "head") -> None:
        """Apply the packaged Alembic migrations (idempotent)."""
        command.upgrade(self.alembic_config(), revision)

    def downgrade(self, revision: str) -> None:
        command.downgrade(self.alembic_config(), revision)

    def verify_schema(self) -> str:
        """Return the current revision if it is this release's head; otherwise refuse with SCHEMA_MISMATCH:
        an older (or empty) database names the upgrade command, a newer or unknown one is refused outright."""
        current = self.current_revision()
        head = self.head_revision()
        if current == head:
            return current
        scripts = ScriptDirectory.from_config(self.alembic_config())
        known = {script.revision for script in scripts.walk_revisions()}
        details = {"current": current, "expected": head}
        if current is None or current in known:
            state = "is empty" if current is None else f"is at revision {current}"
            raise AlloyError(
                ErrorCode.SCHEMA_MISMATCH,
                f"database schema {state}, this Alloy needs {head}; run: {UPGRADE_COMMAND}",
                {**details, "command": UPGRADE_COMMAND},
            )
        raise AlloyError(
            ErrorCode.SCHEMA_MISMATCH,
            f"database schema revision {current} is newer than this Alloy (which knows up to {head}); "
            "refusing to run against it: upgrade Alloy instead",
            details,
        )

    def close(self) -> None:
        self.engine.dispose()
