"""``alloy key create|list|revoke`` and ``alloy key-rotate``: API keys in the configured database.

A new key's plaintext is printed once, on stdout, and never logged; everything else (notices) goes to stderr
so ``KEY=$(alloy key create --owner ci --scope read --quiet)`` captures just the key.
"""

from __future__ import annotations

import json
import re
from datetime import datetime, timedelta, timezone

import click

from alloy.errors import AlloyError
from alloy.storage.keys import SCOPES, ApiKeyRecord, ApiKeyStore, describe

_DURATION = re.compile(r"^(\d+)([smhd])$")
_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def _store() -> ApiKeyStore:
    from alloy.cli.data import cli_settings, open_existing_database

    return ApiKeyStore(open_existing_database(cli_settings()))  # an old schema names "alloy db upgrade"


def _fail(error: AlloyError) -> click.ClickException:
    return click.ClickException(f"{error.code.value}: {error.message}")


def _parse_duration(text: str) -> timedelta:
    match = _DURATION.fullmatch(text.strip())
    if not match:
        raise click.BadParameter(f"{text!r}: use a number and a unit s, m, h or d, e.g. 90d")
    return timedelta(seconds=int(match[1]) * _UNIT_SECONDS[match[2]])


def _show_new_key(record: ApiKeyRecord, plaintext: str, *, as_json: bool, quiet: bool) -> None:
    if quiet:
        click.echo(plaintext)
    elif as_json:
        click.echo(json.dumps({**describe(record), "key": plaintext}, indent=2))
    else:
        click.echo(f"key_id:  {record.key_id}\nowner:   {record.owner}\nscopes:  {','.join(record.scopes)}")
        if record.expires_at:
            click.echo(f"expires: {record.expires_at.isoformat()}")
        click.echo(f"key:     {plaintext}")
    click.echo("Store this key now: it is shown only once and cannot be recovered.", err=True)


@click.group()
def key() -> None:
    """Manage API keys (create, list, revoke). Rotation: ``alloy key-rotate``."""


@key.command("create")
@click.option("--owner", required=True, help="Who the key belongs to (a person, team or service)")
@click.option(
    "--scope",
    "scopes",
    multiple=True,
    type=click.Choice(SCOPES),
    default=("read",),
    show_default=True,
    help="Repeatable; admin implies write implies read",
)
@click.option("--read-limit", default=None, help="Per-key read limit, e.g. 500/minute (default: configured)")
@click.option("--jobs-limit", default=None, help="Per-key job-creation limit, e.g. 20/minute (default: configured)")
@click.option("--expires-in", default=None, help="Lifetime such as 30d, 12h (default: no expiry)")
@click.option("--json", "as_json", is_flag=True, help="Print the record and key as JSON")
@click.option("--quiet", is_flag=True, help="Print only the key")
def create(
    owner: str,
    scopes: tuple[str, ...],
    read_limit: str | None,
    jobs_limit: str | None,
    expires_in: str | None,
    as_json: bool,
    quiet: bool,
) -> None:
    """Create a key and print it once."""
    expires_at = datetime.now(timezone.utc) + _parse_duration(expires_in) if expires_in else None
    try:
        record, plaintext = _store().create(
            owner, scopes, read_limit=read_limit, jobs_limit=jobs_limit, expires_at=expires_at
        )
    except AlloyError as error:
        raise _fail(error) from None
    _show_new_key(record, plaintext, as_json=as_json, quiet=quiet)


@key.command("list")
@click.option("--active", "active_only", is_flag=True, help="Only keys that are neither revoked nor expired")
@click.option("--json", "as_json", is_flag=True)
def list_keys(active_only: bool, as_json: bool) -> None:
    """List keys (never their secrets)."""
    try:
        records = _store().list(include_inactive=not active_only)
    except AlloyError as error:
        raise _fail(error) from None
    rows = [describe(record) for record in records]
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    click.echo(f"{'KEY_ID':<18} {'OWNER':<20} {'SCOPES':<18} {'STATUS':<8} {'EXPIRES':<26} ROTATED_FROM")
    for row in rows:
        click.echo(
            f"{row['key_id']:<18} {row['owner'][:20]:<20} {','.join(row['scopes']):<18} {row['status']:<8} "
            f"{row['expires_at'] or '-':<26} {row['rotated_from'] or '-'}"
        )


@key.command("revoke")
@click.argument("key_id")
def revoke(key_id: str) -> None:
    """Revoke a key at once."""
    try:
        record = _store().revoke(key_id)
    except AlloyError as error:
        raise _fail(error) from None
    click.echo(
        f"revoked {record.key_id} (owner {record.owner}) at {record.revoked_at.isoformat() if record.revoked_at else '-'}"
    )


@click.command("key-rotate")
@click.argument("key_id")
@click.option(
    "--grace-seconds",
    type=click.IntRange(min=0),
    default=None,
    help="How long the old key keeps working (default: auth.rotation_grace_seconds)",
)
@click.option("--json", "as_json", is_flag=True)
@click.option("--quiet", is_flag=True, help="Print only the new key")
def key_rotate(key_id: str, grace_seconds: int | None, as_json: bool, quiet: bool) -> None:
    """Issue a new key (new key ID) replacing KEY_ID; the old key stops working after the grace period."""
    # lazy: a command imports only what it runs (`alloy stop` never loads Ray, `alloy key` never torch)
    from alloy.config import load_settings

    grace = grace_seconds if grace_seconds is not None else load_settings().auth.rotation_grace_seconds
    try:
        record, plaintext = _store().rotate(key_id, grace)
    except AlloyError as error:
        raise _fail(error) from None
    _show_new_key(record, plaintext, as_json=as_json, quiet=quiet)
    click.echo(f"{key_id} stops working in {grace} s; new key id {record.key_id}", err=True)
