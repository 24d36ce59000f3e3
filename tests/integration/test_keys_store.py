"""ApiKeyStore against real databases: hashing, verification, revocation, expiry, rotation, bootstrap, and the
CLI; and that no plaintext key ever reaches a log record."""

from __future__ import annotations

import json
import logging
import sqlite3
from datetime import datetime, timedelta, timezone

import pytest
from click.testing import CliRunner
from pydantic import SecretStr

from alloy.cli.main import cli
from alloy.errors import AlloyError, ErrorCode
from alloy.storage.db import Database
from alloy.storage.keys import BOOTSTRAP_KEY_ID, ApiKeyStore, Principal, parse_key


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = datetime(2030, 1, 1, tzinfo=timezone.utc)

    def __call__(self) -> datetime:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += timedelta(seconds=seconds)


@pytest.fixture
def sqlite_db(tmp_path):
    database = Database(f"sqlite:///{tmp_path / 'keys.db'}")
    database.upgrade()
    yield database
    database.close()


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def store(sqlite_db, clock):
    return ApiKeyStore(sqlite_db, clock=clock)


def test_create_verify_roundtrip_on_both_backends(database):
    store = ApiKeyStore(database)
    record, plaintext = store.create("alice", ["write"], read_limit="500/minute", jobs_limit="20/minute")
    assert plaintext.startswith(f"alloy_{record.key_id}_")
    principal = store.verify(plaintext)
    assert principal == Principal(
        key_id=record.key_id,
        owner="alice",
        scopes=frozenset({"write"}),
        limits={"read": "500/minute", "jobs": "20/minute"},
    )
    assert store.verify(plaintext[:-1] + ("A" if plaintext[-1] != "A" else "B")) is None
    assert [r.key_id for r in store.list()] == [record.key_id]


def test_only_a_hash_is_stored(store, sqlite_db, tmp_path):
    record, plaintext = store.create("alice", ["read"])
    secret = parse_key(plaintext)[1]
    raw = (tmp_path / "keys.db").read_bytes() + (tmp_path / "keys.db-wal").read_bytes()
    assert secret.encode() not in raw and plaintext.encode() not in raw
    row = (
        sqlite3.connect(tmp_path / "keys.db")
        .execute("select secret_hash from api_keys where key_id = ?", (record.key_id,))
        .fetchone()
    )
    assert row[0].startswith("sha256$") and secret not in row[0]
    assert "secret" not in record.model_dump() and "hash" not in json.dumps(record.model_dump(mode="json"))


@pytest.mark.parametrize(
    "presented", ["", "alloy_", "alloy_zz_secret", "short", "x" * 600, "Bearer alloy_0123456789abcdef_x"]
)
def test_malformed_keys_do_not_verify(store, presented):
    store.create("alice", ["read"])
    assert store.verify(presented) is None


def test_unknown_key_id_does_not_verify(store):
    _, plaintext = store.create("alice", ["read"])
    assert store.verify("alloy_0123456789abcdef_" + plaintext.split("_", 2)[2]) is None


def test_revoked_and_expired_keys_stop_verifying(store, clock):
    _, revoked = store.create("alice", ["read"])
    record, expiring = store.create("bob", ["read"], expires_at=clock.now + timedelta(seconds=30))
    store.revoke(parse_key(revoked)[0])
    assert store.verify(revoked) is None
    assert store.verify(expiring) is not None
    clock.advance(30)
    assert store.verify(expiring) is None
    statuses = {r.key_id: r.status(clock.now) for r in store.list()}
    assert sorted(statuses.values()) == ["expired", "revoked"]
    assert store.list(include_inactive=False) == []


def test_revoke_unknown_key_is_not_found(store):
    with pytest.raises(AlloyError) as caught:
        store.revoke("0123456789abcdef")
    assert caught.value.code is ErrorCode.NOT_FOUND


def test_rotation_keeps_the_old_key_for_the_grace_period(store, clock):
    old, old_plain = store.create("svc", ["write"], jobs_limit="3/minute")
    new, new_plain = store.rotate(old.key_id, grace_seconds=60)
    assert new.key_id != old.key_id and new.rotated_from == old.key_id
    assert (new.owner, new.scopes, new.jobs_limit) == ("svc", ["write"], "3/minute")
    assert {r.key_id for r in store.list()} == {old.key_id, new.key_id}
    clock.advance(59)
    assert store.verify(old_plain) is not None and store.verify(new_plain) is not None
    clock.advance(1)
    assert store.verify(old_plain) is None and store.verify(new_plain) is not None
    with pytest.raises(AlloyError) as caught:
        store.rotate(old.key_id, 10)  # an expired key cannot be rotated again
    assert caught.value.code is ErrorCode.CONFLICT


def test_rotation_with_zero_grace_is_immediate(store):
    old, old_plain = store.create("svc", ["read"])
    store.rotate(old.key_id, 0)
    assert store.verify(old_plain) is None


@pytest.mark.parametrize(
    "kwargs",
    [{"scopes": []}, {"scopes": ["root"]}, {"read_limit": "lots"}, {"jobs_limit": "10/fortnight"}, {"owner": ""}],
)
def test_invalid_key_settings_are_validation_errors(store, kwargs):
    arguments = {"owner": "alice", "scopes": ["read"], **kwargs}
    with pytest.raises(AlloyError) as caught:
        store.create(arguments.pop("owner"), arguments.pop("scopes"), **arguments)
    assert caught.value.code is ErrorCode.VALIDATION_FAILED


def test_scope_implication():
    def principal(*scopes):
        return Principal(key_id="k", owner="o", scopes=frozenset(scopes))

    assert principal("admin").has_scope("read") and principal("admin").has_scope("write")
    assert principal("write").has_scope("read") and not principal("write").has_scope("admin")
    assert not principal("read").has_scope("write")


def test_bootstrap_admin_is_created_once(store):
    plaintext = store.ensure_bootstrap_admin(None)
    assert plaintext is not None
    principal = store.verify(plaintext)
    assert principal is not None and principal.key_id == BOOTSTRAP_KEY_ID and principal.has_scope("admin")
    assert store.ensure_bootstrap_admin(None) is None
    store.revoke(BOOTSTRAP_KEY_ID)
    assert store.ensure_bootstrap_admin(None) is None  # never re-issued silently; recover with the CLI


def test_configured_admin_key_is_imported(store):
    configured = "operator-chosen-admin-key-of-sufficient-length"
    assert store.ensure_bootstrap_admin(SecretStr(configured)) is None
    assert store.verify(configured).has_scope("admin")
    assert store.ensure_bootstrap_admin(configured) is None  # idempotent
    assert len(store.list()) == 1


def test_configured_admin_key_must_be_long(store):
    with pytest.raises(AlloyError) as caught:
        store.ensure_bootstrap_admin("short")
    assert caught.value.code is ErrorCode.VALIDATION_FAILED


def test_no_plaintext_key_is_logged(store, caplog):
    caplog.set_level(logging.DEBUG)
    keys = [store.ensure_bootstrap_admin(None)]
    record, plaintext = store.create("alice", ["write"])
    keys.append(plaintext)
    store.verify(plaintext)
    store.verify(plaintext + "wrong")
    keys.append(store.rotate(record.key_id, 5)[1])
    store.ensure_bootstrap_admin("configured-admin-key-0123456789abcdef")
    keys.append("configured-admin-key-0123456789abcdef")
    assert caplog.records, "the store logs its key events"
    logged = "\n".join(r.getMessage() + repr(r.args) for r in caplog.records)
    for key in keys:
        assert key not in logged and parse_key(key)[1] not in logged
    assert record.key_id in logged  # key ids are public and do appear


def test_cli_create_list_rotate_revoke(tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.DEBUG)
    monkeypatch.setenv("ALLOY_DATA_DIR", str(tmp_path / "var"))
    monkeypatch.setenv("ALLOY_CONFIG", str(tmp_path / "absent.yaml"))
    monkeypatch.setenv("ALLOY_AUTH__ROTATION_GRACE_SECONDS", "0")
    runner = CliRunner()
    database = Database(f"sqlite:///{tmp_path / 'var' / 'alloy.db'}")
    unupgraded = runner.invoke(cli, ["key", "list"])
    # A read command never creates or migrates a database: it says in one line where to point the CLI.
    assert unupgraded.exit_code == 1 and "run `alloy start` first" in unupgraded.output
    database.upgrade()

    created = runner.invoke(
        cli, ["key", "create", "--owner", "ci", "--scope", "write", "--jobs-limit", "5/minute", "--json"]
    )
    assert created.exit_code == 0, created.output
    data = json.loads(created.stdout)
    store = ApiKeyStore(database)
    assert store.verify(data["key"]).limits.jobs == "5/minute"

    rotated = runner.invoke(cli, ["key-rotate", data["key_id"], "--quiet"])
    assert rotated.exit_code == 0, rotated.output
    new_key = rotated.stdout.strip()
    new_id = parse_key(new_key)[0]
    assert new_id != data["key_id"]
    assert store.verify(data["key"]) is None and store.verify(new_key) is not None  # default grace: 0 from env

    listing = json.loads(runner.invoke(cli, ["key", "list", "--json"]).stdout)
    assert {row["key_id"]: row["status"] for row in listing} == {data["key_id"]: "expired", new_id: "active"}
    assert all("key" not in row and "secret_hash" not in row for row in listing)

    assert runner.invoke(cli, ["key", "revoke", new_id]).exit_code == 0
    assert store.verify(new_key) is None
    missing = runner.invoke(cli, ["key", "revoke", "0123456789abcdef"])
    assert missing.exit_code == 1 and "NOT_FOUND" in missing.output
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert data["key"] not in logged and new_key not in logged
