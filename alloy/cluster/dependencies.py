"""Validation of the external dependencies before a cold start: database, object store, message queue (when
configured) and GPU nodes (when the profile needs them).

Every check does real work against the real thing (a query, a probe object written/read/deleted, a protocol
handshake with authentication), with a short timeout. All checks run, then one error names every failure, so
an operator fixing a misconfiguration sees the whole list at once. Secrets never appear in a target or message.

Message queues are checked with their own client libraries (:mod:`alloy.cluster.queue_checks`): a login to
the AMQP vhost (pika), a NATS CONNECT + flush (nats-py), a Redis PING (redis-py).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from urllib.parse import urlsplit

from pydantic import BaseModel
from sqlalchemy import text
from sqlalchemy.engine import make_url

from alloy.cluster.queue_checks import DependencyFailed, check_amqp, check_nats, check_redis
from alloy.config import Settings
from alloy.errors import AlloyError, ErrorCode
from alloy.storage.artifacts import ArtifactStore
from alloy.storage.db import Database

DEFAULT_TIMEOUT_S = 5.0
PROBE_PREFIX = ".alloy-probe"


class DependencyCheck(BaseModel):
    name: str  # database | object store | message queue | GPU nodes
    target: str  # where, with any password masked
    ok: bool
    duration_s: float
    detail: str


class DependencyReport(BaseModel):
    checks: list[DependencyCheck]

    @property
    def ok(self) -> bool:
        return all(check.ok for check in self.checks)

    @property
    def failures(self) -> list[DependencyCheck]:
        return [check for check in self.checks if not check.ok]

    def summary(self) -> str:
        return ", ".join(f"{c.name} {'ok' if c.ok else 'FAILED'} ({c.duration_s * 1000:.0f} ms)" for c in self.checks)

    def raise_for_failures(self) -> DependencyReport:
        failures = self.failures
        if not failures:
            return self
        gpu_only = all(c.name == "GPU nodes" for c in failures)
        message = "dependency check failed: " + "; ".join(f"{c.name} at {c.target}: {c.detail}" for c in failures)
        raise AlloyError(
            ErrorCode.GPU_UNAVAILABLE if gpu_only else ErrorCode.SERVICE_UNAVAILABLE,
            message,
            {"failed": [c.name for c in failures], "checks": [c.model_dump() for c in self.checks]},
        )


def masked(url: str) -> str:
    """The URL with its password (or token) replaced by ***."""
    parts = urlsplit(url)
    if not parts.netloc or "@" not in parts.netloc:
        return url
    userinfo, host = parts.netloc.rsplit("@", 1)
    user = userinfo.split(":", 1)[0] if ":" in userinfo else "***"
    netloc = f"{user}:***@{host}" if ":" in userinfo else f"***@{host}"
    return parts._replace(netloc=netloc).geturl()


def _run(name: str, target: str, check: Callable[[], str]) -> DependencyCheck:
    started = time.perf_counter()
    try:
        detail, ok = check(), True
    except DependencyFailed as exc:
        detail, ok = str(exc), False
    except AlloyError as exc:
        detail, ok = exc.message, False
    except TimeoutError:  # socket.timeout is TimeoutError: the port answered but not with the protocol
        detail, ok = "timed out waiting for the server's answer (wrong port or protocol?)", False
    except Exception as exc:  # noqa: BLE001 - any failure of a dependency is reported, not raised
        detail, ok = f"{type(exc).__name__}: {exc}", False
    return DependencyCheck(
        name=name, target=target, ok=ok, duration_s=round(time.perf_counter() - started, 4), detail=detail[:500]
    )


# --- database ------------------------------------------------------------------------------------------------


def check_database(db: Database) -> DependencyCheck:
    def probe() -> str:
        with db.engine.connect() as connection:
            if connection.execute(text("SELECT 1")).scalar() != 1:
                raise DependencyFailed("SELECT 1 did not return 1")
        return f"SELECT 1 ok ({db.engine.dialect.name})"

    return _run("database", make_url(db.url).render_as_string(hide_password=True), probe)


# --- object store --------------------------------------------------------------------------------------------


def check_object_store(store: ArtifactStore) -> DependencyCheck:
    """Write, read back and delete a probe object (a read-only or full store fails here, not mid-merge)."""

    def probe() -> str:
        key = f"{PROBE_PREFIX}/{uuid.uuid4().hex}"
        payload = uuid.uuid4().bytes
        store.put_bytes(key, payload)
        try:
            if store.read_bytes(key) != payload:
                raise DependencyFailed("probe object read back different bytes")
        finally:
            store.delete(key)
        if store.exists(key):
            raise DependencyFailed("probe object still visible after delete")
        return "write/read/delete ok"

    return _run("object store", store.uri, probe)


# --- message queues ------------------------------------------------------------------------------------------


def check_message_queue(url: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> DependencyCheck:
    scheme = urlsplit(url).scheme.lower()
    checks = {
        "amqp": check_amqp,
        "amqps": check_amqp,
        "nats": check_nats,
        "tls": check_nats,
        "redis": check_redis,
        "rediss": check_redis,
    }
    if scheme not in checks:
        return DependencyCheck(
            name="message queue",
            target=masked(url),
            ok=False,
            duration_s=0.0,
            detail=f"unsupported scheme {scheme!r}: use amqp://, nats:// or redis://",
        )
    return _run("message queue", masked(url), lambda: checks[scheme](url, timeout_s))


# --- GPU nodes -----------------------------------------------------------------------------------------------


def check_gpu_nodes(gpu_count: Callable[[], float], required: float = 1) -> DependencyCheck:
    """``gpu_count`` returns the cluster's total GPUs (on Ray: ``ray.cluster_resources().get("GPU", 0)``)."""

    def probe() -> str:
        count = float(gpu_count())
        if count < required:
            raise DependencyFailed(f"the gpu profile needs at least {required:g} GPU, the cluster has {count:g}")
        return f"{count:g} GPU available"

    return _run("GPU nodes", "cluster resources", probe)


def _no_gpu_probe() -> float:
    raise DependencyFailed("no GPU probe was given (the start sequence passes the cluster's)")


# --- all of them ---------------------------------------------------------------------------------------------


def validate_dependencies(
    settings: Settings,
    *,
    db: Database | None = None,
    store: ArtifactStore | None = None,
    gpu_count: Callable[[], float] | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> DependencyReport:
    """Check every dependency the settings name and return the report (``raise_for_failures()`` turns it
    into the error). A database or store the caller already opened is reused; otherwise one is opened from
    the settings and closed again."""
    checks = [_database_check(settings, db), _store_check(settings, store, timeout_s)]
    if settings.message_queue_url:
        checks.append(check_message_queue(settings.message_queue_url, timeout_s))
    if settings.profile == "gpu":
        # The probe comes from the caller (alloy.control.nodes.cluster_gpu_count on Ray): this package is Ray-free.
        checks.append(check_gpu_nodes(gpu_count or _no_gpu_probe))
    return DependencyReport(checks=checks)


def _database_check(settings: Settings, db: Database | None) -> DependencyCheck:

    if db is not None:
        return check_database(db)
    try:
        db = Database.from_settings(settings)
    except Exception as exc:  # noqa: BLE001 - a malformed URL is a failed check, reported like the others
        target = settings.database_url
        try:
            target = make_url(target).render_as_string(hide_password=True)
        except Exception:  # noqa: BLE001
            target = masked(target)
        return DependencyCheck(
            name="database", target=target, ok=False, duration_s=0.0, detail=f"{type(exc).__name__}: {exc}"[:500]
        )
    try:
        return check_database(db)
    finally:
        db.close()


def _store_check(settings: Settings, store: ArtifactStore | None, timeout_s: float) -> DependencyCheck:
    """The store from the settings, with S3 timeouts and retries capped so an unreachable endpoint fails in
    seconds rather than after botocore's minutes of retries."""
    if store is not None:
        return check_object_store(store)
    options = dict(settings.storage_options)
    if settings.artifacts_uri.startswith("s3://"):
        options["config_kwargs"] = {
            "connect_timeout": timeout_s,
            "read_timeout": timeout_s,
            "retries": {"max_attempts": 1},
        }
    try:
        store = ArtifactStore(settings.artifacts_uri, options)
    except Exception as exc:  # noqa: BLE001
        return DependencyCheck(
            name="object store",
            target=masked(settings.artifacts_uri),
            ok=False,
            duration_s=0.0,
            detail=f"{type(exc).__name__}: {exc}"[:500],
        )
    return check_object_store(store)
