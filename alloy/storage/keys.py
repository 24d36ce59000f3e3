"""API keys: creation, verification, revocation and rotation, stored hashed in the ``api_keys`` table.

Key format: ``alloy_<key_id>_<secret>``. ``key_id`` is 16 lowercase hex characters (public: it names the key in
``alloy key list``, logs and the registry); ``secret`` is 43 URL-safe characters from ``secrets.token_urlsafe(32)``
(256 random bits). Because the key ID is part of the key, verification is one primary-key lookup.

Hashing: only ``sha256(key_id ":" secret)`` is stored (as ``sha256$<hex>``) and compared in constant time. A slow
password KDF (bcrypt, scrypt, argon2) protects *low-entropy* human passwords against guessing; a 256-bit random
secret cannot be guessed, so a fast hash gives the same protection for a stolen table while keeping the check
on every request cheap. Binding the key ID into the hash stops a hash from being replayed under another ID.

A key configured by the operator (``auth.admin_key``) may be any string of at least 32 characters. If it has the
Alloy format its ID is used; otherwise its ID is derived from its hash (``cfg`` + 13 hex characters), so it can be
looked up the same way.

Scopes: ``read`` < ``write`` < ``admin``; a scope implies the ones below it (see :meth:`Principal.has_scope`).
Plaintext keys are returned to the caller exactly once and never logged.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import re
import secrets
from collections.abc import Callable, Iterable
from datetime import datetime, timedelta, timezone
from typing import Any

from limits import parse as parse_limit
from pydantic import BaseModel, ConfigDict, SecretStr
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError

from alloy.errors import AlloyError, ErrorCode
from alloy.storage.db import Database
from alloy.storage.db.models import ApiKeyRow

logger = logging.getLogger("alloy.storage.keys")

KEY_PREFIX = "alloy"
SCOPES = ("read", "write", "admin")  # ordered: each implies those before it
_SCOPE_RANK = {scope: rank for rank, scope in enumerate(SCOPES)}
_KEY_FORMAT = re.compile(
    r"^alloy_(?P<key_id>[0-9a-f]{16}|cfg[0-9a-f]{13}|bootstrap)_(?P<secret>[A-Za-z0-9_-]{20,200})$"
)
MIN_CONFIGURED_KEY_LENGTH = 32
MAX_PRESENTED_KEY_LENGTH = 512
BOOTSTRAP_KEY_ID = "bootstrap"  # fixed, so that replicas racing through the first start create only one key
BOOTSTRAP_OWNER = "admin"
LAST_USED_RESOLUTION = timedelta(seconds=60)  # last_used_at is refreshed at most this often (saves a write per request)


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


class KeyLimits(BaseModel):
    """Per-key rate limits in ``limits`` notation (``"100/minute"``); None means the configured default."""

    model_config = ConfigDict(frozen=True)

    read: str | None = None
    jobs: str | None = None


class Principal(BaseModel):
    """Who is calling: the verified key's identity, stored on ``request.state.principal``."""

    model_config = ConfigDict(frozen=True)

    key_id: str
    owner: str
    scopes: frozenset[str]
    limits: KeyLimits = KeyLimits()

    def has_scope(self, scope: str) -> bool:
        """``admin`` implies ``write`` and ``read``; ``write`` implies ``read``."""
        needed = _SCOPE_RANK[scope]
        return any(_SCOPE_RANK.get(held, -1) >= needed for held in self.scopes)


class ApiKeyRecord(BaseModel):
    """A key as listed: everything except its secret and hash."""

    key_id: str
    owner: str
    scopes: list[str]
    read_limit: str | None
    jobs_limit: str | None
    created_at: datetime
    expires_at: datetime | None
    revoked_at: datetime | None
    rotated_from: str | None
    last_used_at: datetime | None

    def status(self, now: datetime | None = None) -> str:
        now = now or utcnow()
        if self.revoked_at is not None:
            return "revoked"
        if self.expires_at is not None and self.expires_at <= now:
            return "expired"
        return "active"

    @classmethod
    def from_row(cls, row: ApiKeyRow) -> ApiKeyRecord:
        return cls(
            key_id=row.key_id,
            owner=row.owner,
            scopes=list(row.scopes or []),
            read_limit=row.read_limit,
            jobs_limit=row.jobs_limit,
            created_at=row.created_at,
            expires_at=row.expires_at,
            revoked_at=row.revoked_at,
            rotated_from=row.rotated_from,
            last_used_at=row.last_used_at,
        )


def _hash_secret(key_id: str, secret: str) -> str:
    return "sha256$" + hashlib.sha256(f"{key_id}:{secret}".encode()).hexdigest()


def _derived_key_id(plaintext: str) -> str:
    return "cfg" + hashlib.sha256(plaintext.encode()).hexdigest()[:13]


def parse_key(plaintext: str) -> tuple[str, str] | None:
    """``(key_id, secret)`` of a presented key, or None if it cannot be an Alloy key."""
    if not plaintext or len(plaintext) > MAX_PRESENTED_KEY_LENGTH:
        return None
    match = _KEY_FORMAT.fullmatch(plaintext)
    if match:
        return match["key_id"], match["secret"]
    if len(plaintext) >= MIN_CONFIGURED_KEY_LENGTH and plaintext.isprintable():
        return _derived_key_id(plaintext), plaintext  # an operator-chosen key
    return None


def _new_plaintext(key_id: str) -> str:
    return f"{KEY_PREFIX}_{key_id}_{secrets.token_urlsafe(32)}"


def _validate_scopes(scopes: Iterable[str]) -> list[str]:
    chosen = (
        sorted(set(scopes), key=lambda scope: _SCOPE_RANK[scope]) if all(s in _SCOPE_RANK for s in scopes) else None
    )
    if not chosen:
        raise AlloyError(
            ErrorCode.VALIDATION_FAILED, f"scopes must be a non-empty subset of {list(SCOPES)}", {"field": "scopes"}
        )
    return chosen


def validate_limit(text: str | None, field: str) -> str | None:
    """Check a ``limits``-notation rate (``"100/minute"``, ``"10 per 1 minute"``)."""
    if text is None:
        return None
    try:
        parse_limit(text)
    except ValueError:
        raise AlloyError(
            ErrorCode.VALIDATION_FAILED, f"{field}: {text!r} is not a rate such as '100/minute'", {"field": field}
        ) from None
    return text


def _validate_owner(owner: str) -> str:
    if not owner or len(owner) > 128 or not owner.isprintable():
        raise AlloyError(ErrorCode.VALIDATION_FAILED, "owner must be 1-128 printable characters", {"field": "owner"})
    return owner


def _secret_text(value: str | SecretStr | None) -> str | None:
    return value.get_secret_value() if isinstance(value, SecretStr) else value


class ApiKeyStore:
    """Hashed API keys in the database. ``clock`` is injectable so expiry can be tested without waiting."""

    def __init__(self, db: Database, *, clock: Callable[[], datetime] = utcnow):
        self.db = db
        self.clock = clock

    # -- management -----------------------------------------------------------------------------------------
    def create(
        self,
        owner: str,
        scopes: Iterable[str],
        *,
        read_limit: str | None = None,
        jobs_limit: str | None = None,
        expires_at: datetime | None = None,
        rotated_from: str | None = None,
    ) -> tuple[ApiKeyRecord, str]:
        """Create a key; return its record and the plaintext, which is not stored and cannot be shown again."""
        key_id = secrets.token_hex(8)
        plaintext = _new_plaintext(key_id)
        record = self._insert(key_id, plaintext, owner, scopes, read_limit, jobs_limit, expires_at, rotated_from)
        logger.info("api key created key_id=%s owner=%s scopes=%s", key_id, record.owner, record.scopes)
        return record, plaintext

    def _insert(
        self,
        key_id: str,
        plaintext: str,
        owner: str,
        scopes: Iterable[str],
        read_limit: str | None,
        jobs_limit: str | None,
        expires_at: datetime | None,
        rotated_from: str | None,
    ) -> ApiKeyRecord:
        parsed = parse_key(plaintext)
        assert parsed is not None and parsed[0] == key_id
        if expires_at is not None and expires_at.tzinfo is None:
            raise AlloyError(ErrorCode.VALIDATION_FAILED, "expires_at must be timezone-aware", {"field": "expires_at"})
        row = ApiKeyRow(
            key_id=key_id,
            owner=_validate_owner(owner),
            secret_hash=_hash_secret(key_id, parsed[1]),
            scopes=_validate_scopes(list(scopes)),
            read_limit=validate_limit(read_limit, "read_limit"),
            jobs_limit=validate_limit(jobs_limit, "jobs_limit"),
            created_at=self.clock(),
            expires_at=expires_at,
            rotated_from=rotated_from,
        )
        with self.db.session() as session:
            session.add(row)
            session.flush()
            return ApiKeyRecord.from_row(row)

    def get(self, key_id: str) -> ApiKeyRecord:
        with self.db.session() as session:
            row = session.get(ApiKeyRow, key_id)
            if row is None:
                raise AlloyError(ErrorCode.NOT_FOUND, f"api key {key_id!r} does not exist", {"key_id": key_id})
            return ApiKeyRecord.from_row(row)

    def list(self, *, include_inactive: bool = True) -> list[ApiKeyRecord]:
        with self.db.session() as session:
            rows = session.scalars(select(ApiKeyRow).order_by(ApiKeyRow.created_at, ApiKeyRow.key_id)).all()
            records = [ApiKeyRecord.from_row(row) for row in rows]
        if include_inactive:
            return records
        now = self.clock()
        return [r for r in records if r.status(now) == "active"]

    def revoke(self, key_id: str) -> ApiKeyRecord:
        """Revoke at once (idempotent: revoking a revoked key keeps its first revocation time)."""
        with self.db.session() as session:
            row = session.get(ApiKeyRow, key_id)
            if row is None:
                raise AlloyError(ErrorCode.NOT_FOUND, f"api key {key_id!r} does not exist", {"key_id": key_id})
            if row.revoked_at is None:
                row.revoked_at = self.clock()
            record = ApiKeyRecord.from_row(row)
        logger.info("api key revoked key_id=%s", key_id)
        return record

    def rotate(self, key_id: str, grace_seconds: float) -> tuple[ApiKeyRecord, str]:
        """Issue a new key (new ID, same owner, scopes and limits) and let the old one expire after
        ``grace_seconds`` (0: at once). An earlier existing expiry of the old key is kept."""
        if grace_seconds < 0:
            raise AlloyError(ErrorCode.VALIDATION_FAILED, "grace_seconds must be >= 0", {"field": "grace_seconds"})
        old = self.get(key_id)
        if old.status(self.clock()) != "active":
            raise AlloyError(
                ErrorCode.CONFLICT,
                f"api key {key_id!r} is {old.status(self.clock())}; only an active key can be rotated",
                {"key_id": key_id},
            )
        record, plaintext = self.create(
            old.owner,
            old.scopes,
            read_limit=old.read_limit,
            jobs_limit=old.jobs_limit,
            expires_at=old.expires_at,
            rotated_from=key_id,
        )
        cutoff = self.clock() + timedelta(seconds=grace_seconds)
        with self.db.session() as session:
            row = session.get(ApiKeyRow, key_id)
            assert row is not None
            if row.expires_at is None or row.expires_at > cutoff:
                row.expires_at = cutoff
        logger.info(
            "api key rotated old_key_id=%s new_key_id=%s grace_seconds=%s", key_id, record.key_id, grace_seconds
        )
        return record, plaintext

    # -- verification ---------------------------------------------------------------------------------------
    def verify(self, plaintext: str) -> Principal | None:
        """The principal of a presented key, or None if it is unknown, wrong, revoked or expired."""
        parsed = parse_key(plaintext)
        if parsed is None:
            return None
        key_id, secret = parsed
        now = self.clock()
        with self.db.session() as session:
            row = session.get(ApiKeyRow, key_id)
            if row is None or not hmac.compare_digest(row.secret_hash, _hash_secret(key_id, secret)):
                return None
            if row.revoked_at is not None or (row.expires_at is not None and row.expires_at <= now):
                return None
            if row.last_used_at is None or now - row.last_used_at >= LAST_USED_RESOLUTION:
                row.last_used_at = now
            return Principal(
                key_id=row.key_id,
                owner=row.owner,
                scopes=frozenset(row.scopes or ()),
                limits=KeyLimits(read=row.read_limit, jobs=row.jobs_limit),
            )

    # -- first start ----------------------------------------------------------------------------------------
    def ensure_bootstrap_admin(self, configured_key: str | SecretStr | None = None) -> str | None:
        """Make sure an admin can get in on the first start.

        With ``configured_key`` (``auth.admin_key``): import it as an admin key unless it is already stored (a
        revoked configured key stays revoked). Returns None: the operator already knows it.
        Without: if no admin key has ever existed, create one and return its plaintext, to be shown once to the
        operator (print it; never log it). Otherwise None; lost admin access is recovered with
        ``alloy key create --scope admin`` by someone with database access.
        """
        configured = _secret_text(configured_key)
        if configured:
            self._import_configured_admin(configured)
            return None
        with self.db.session() as session:
            any_admin = any("admin" in (scopes or []) for scopes in session.scalars(select(ApiKeyRow.scopes)))
        if any_admin:
            return None
        plaintext = _new_plaintext(BOOTSTRAP_KEY_ID)
        try:
            self._insert(BOOTSTRAP_KEY_ID, plaintext, BOOTSTRAP_OWNER, ["admin"], None, None, None, None)
        except IntegrityError:
            return None  # another replica created it first
        logger.info("bootstrap admin key created key_id=%s (plaintext shown once to the operator)", BOOTSTRAP_KEY_ID)
        return plaintext

    def _import_configured_admin(self, configured: str) -> None:
        parsed = parse_key(configured)
        if parsed is None:
            raise AlloyError(
                ErrorCode.VALIDATION_FAILED,
                f"auth.admin_key must be an Alloy key or at least {MIN_CONFIGURED_KEY_LENGTH} printable characters",
                {"field": "auth.admin_key"},
            )
        key_id, secret = parsed
        with self.db.session() as session:
            row = session.get(ApiKeyRow, key_id)
        if row is not None:
            if not hmac.compare_digest(row.secret_hash, _hash_secret(key_id, secret)):
                raise AlloyError(
                    ErrorCode.CONFLICT, f"api key id {key_id!r} exists with another secret", {"key_id": key_id}
                )
            if row.revoked_at is not None:
                logger.warning("configured admin key key_id=%s is revoked; not restoring it", key_id)
            return None
        try:
            self._insert(key_id, configured, BOOTSTRAP_OWNER, ["admin"], None, None, None, None)
            logger.info("configured admin key imported key_id=%s", key_id)
        except IntegrityError:
            pass  # imported concurrently by another replica
        return None


def describe(record: ApiKeyRecord, now: datetime | None = None) -> dict[str, Any]:
    """A JSON-friendly view of a record (for the CLI and admin endpoints)."""
    data = record.model_dump(mode="json")
    data["status"] = record.status(now)
    return data
