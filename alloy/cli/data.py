"""Which data the CLI's commands read: the data dir from ``alloy --data-dir``, ``ALLOY_DATA_DIR`` or the config
(relative to the project root), the same from any folder. Commands that only read (``status``, ``stop``,
``key ...``) never create a database: without one they say in one line what to do."""

from __future__ import annotations

from pathlib import Path

import click
from sqlalchemy.engine import make_url


def cli_settings():
    from alloy.cluster.local_state import local_settings

    return local_settings()


def sqlite_file(database_url: str) -> Path | None:
    url = make_url(database_url)
    if not url.drivername.startswith("sqlite") or not url.database or url.database == ":memory:":
        return None
    return Path(url.database)


def open_existing_database(settings):
    """The configured database, verified; a missing SQLite file is a one-line error, never a new empty file."""
    from alloy.errors import AlloyError
    from alloy.storage.db import Database

    path = sqlite_file(settings.database_url)
    if path is not None and not path.exists():
        raise click.ClickException(
            f"no Alloy data in {settings.data_dir}: run `alloy start` first, or point `alloy --data-dir DIR` "
            "(or ALLOY_DATA_DIR) at the data dir of a running Alloy"
        )
    db = Database.from_settings(settings)
    try:
        db.verify_schema()
    except AlloyError as exc:
        db.close()
        raise click.ClickException(f"{exc.code.value}: {exc.message}") from None
    return db
