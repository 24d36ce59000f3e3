"""``alloy db``: apply and inspect the database schema migrations."""

from __future__ import annotations

import click


def _database():
    # lazy: a command imports only what it runs (`alloy stop` never loads Ray, `alloy key` never torch)
    from alloy.config import load_settings
    from alloy.storage.db import Database

    return Database.from_settings(load_settings())


@click.group()
def db() -> None:
    """Database schema migrations (Alembic, shipped inside Alloy)."""


@db.command()
@click.option("--revision", default="head", show_default=True, help="Target revision.")
def upgrade(revision: str) -> None:
    """Bring the configured database up to this release's schema."""
    database = _database()
    try:
        before = database.current_revision()
        database.upgrade(revision)
        after = database.current_revision()
    finally:
        database.close()
    if before == after:
        click.echo(f"database already at revision {after}")
    else:
        click.echo(f"database upgraded: {before or '(empty)'} -> {after}")


@db.command()
def current() -> None:
    """Show the database's schema revision and whether it matches this release."""
    # lazy: a command imports only what it runs (`alloy stop` never loads Ray, `alloy key` never torch)
    from alloy.errors import AlloyError

    database = _database()
    try:
        revision, head = database.current_revision(), database.head_revision()
        click.echo(f"current: {revision or '(empty)'}")
        click.echo(f"head:    {head}")
        try:
            database.verify_schema()
            click.echo("status:  up to date")
        except AlloyError as exc:
            click.echo(f"status:  {exc.message}")
            raise SystemExit(1) from None
    finally:
        database.close()
