"""Schema migrations and the connect-time schema-version check, on SQLite and PostgreSQL."""

from __future__ import annotations

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from click.testing import CliRunner
from sqlalchemy import inspect, text

from alloy.errors import AlloyError, ErrorCode
from alloy.storage.db import UPGRADE_COMMAND, Database
from alloy.storage.db.models import Base

EXPECTED_TABLES = {
    "models",
    "datasets",
    "jobs",
    "job_events",
    "experiments",
    "experiment_records",
    "trials",
    "artifacts",
    "api_keys",
    "cluster_state",
    "tracker_log",
}


def test_fresh_upgrade_creates_every_table_and_matches_the_orm(empty_database):
    empty_database.upgrade()
    assert empty_database.verify_schema() == empty_database.head_revision()
    assert EXPECTED_TABLES <= set(inspect(empty_database.engine).get_table_names())
    with empty_database.engine.connect() as connection:
        assert compare_metadata(MigrationContext.configure(connection), Base.metadata) == []


def test_upgrade_is_idempotent(database):
    database.upgrade()
    assert database.current_revision() == database.head_revision()


def test_empty_database_is_refused_with_the_upgrade_command(empty_database):
    with pytest.raises(AlloyError) as caught:
        empty_database.verify_schema()
    assert caught.value.code is ErrorCode.SCHEMA_MISMATCH
    assert caught.value.message.endswith(f"run: {UPGRADE_COMMAND}")


def test_older_revision_is_refused_with_the_exact_upgrade_command(empty_database):
    empty_database.upgrade("0001")
    with pytest.raises(AlloyError) as caught:
        empty_database.verify_schema()
    assert caught.value.code is ErrorCode.SCHEMA_MISMATCH
    assert "alloy db upgrade" in caught.value.message
    assert caught.value.details == {
        "current": "0001",
        "expected": empty_database.head_revision(),
        "command": "alloy db upgrade",
    }
    empty_database.upgrade()
    assert empty_database.verify_schema() == empty_database.head_revision()


def test_newer_revision_is_refused_outright(database):
    with database.engine.begin() as connection:
        connection.execute(text("UPDATE alembic_version SET version_num = '9999_from_the_future'"))
    with pytest.raises(AlloyError) as caught:
        database.verify_schema()
    assert caught.value.code is ErrorCode.SCHEMA_MISMATCH
    assert "newer" in caught.value.message
    assert UPGRADE_COMMAND not in caught.value.message


def test_session_rolls_back_on_error(database):
    from alloy.storage.db.models import ClusterStateRow
    from alloy.storage.db.types import utcnow

    with pytest.raises(RuntimeError):
        with database.session() as session:
            session.add(ClusterStateRow(id=1, state="READY", config_version=1, updated_at=utcnow()))
            session.flush()
            raise RuntimeError("boom")
    with database.session() as session:
        assert session.get(ClusterStateRow, 1) is None


def test_timestamps_come_back_timezone_aware_utc(database):
    from datetime import timedelta, timezone

    from alloy.storage.db.models import ClusterStateRow
    from alloy.storage.db.types import utcnow

    moment = utcnow().astimezone(timezone(timedelta(hours=5)))
    with database.session() as session:
        session.add(ClusterStateRow(id=1, state="READY", config_version=3, snapshot={"pools": [1]}, updated_at=moment))
    with database.session() as session:
        row = session.get(ClusterStateRow, 1)
        assert row.updated_at == moment and row.updated_at.utcoffset() == timedelta(0)
        assert row.snapshot == {"pools": [1]}


def test_sqlite_runs_in_wal_mode_with_a_busy_timeout(tmp_path):
    database = Database(f"sqlite:///{tmp_path / 'var' / 'alloy.db'}")
    try:
        with database.engine.connect() as connection:
            assert connection.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
            assert connection.exec_driver_sql("PRAGMA busy_timeout").scalar() >= 5000
    finally:
        database.close()


def test_from_settings_defaults_to_sqlite_under_the_data_dir(tmp_path):
    from alloy.config import Settings

    database = Database.from_settings(Settings(data_dir=tmp_path / "var"))
    try:
        assert database.is_sqlite and database.url.endswith("/var/alloy.db")
    finally:
        database.close()


def test_cli_upgrade_and_current(tmp_path, monkeypatch):
    from alloy.cli.main import cli

    monkeypatch.setenv("ALLOY_CONFIG", str(tmp_path / "absent.yaml"))
    monkeypatch.setenv("ALLOY_DATA_DIR", str(tmp_path / "var"))
    runner = CliRunner()
    before = runner.invoke(cli, ["db", "current"])
    assert before.exit_code == 1 and "run: alloy db upgrade" in before.output
    upgraded = runner.invoke(cli, ["db", "upgrade"])
    assert upgraded.exit_code == 0, upgraded.output
    after = runner.invoke(cli, ["db", "current"])
    assert after.exit_code == 0 and "up to date" in after.output
