"""Validation of the external dependencies before a cold start: database, object store, message queue (when
configured) and GPU nodes (when the profile needs them).

Every check does real work against the real thing (a query, a probe object written/read/deleted, a protocol
handshake with authentication), with a short timeout. All checks run, then one error names every failure, so
an operator fixing a misconfiguration sees the whole list at once. Secrets never appear in a target or message.

Message queues are checked at the protocol level with the standard library (no client library is needed):
- ``amqp://user:pass@host:port/vhost``: AMQP 0-9-1 protocol header, Connection.Start-Ok (PLAIN),
  Tune-Ok, Open (the vhost) and Close; wrong credentials or vhost fail here;
- ``nats://[user:pass@|token@]host:port``: INFO, CONNECT + PING, expecting PONG (``-ERR`` fails);
- ``redis://`` / ``rediss://``: PING through redis-py (a project dependency), AUTH/db from the URL.
"""

from __future__ import annotations

import json
import socket
import struct
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlsplit

from pydantic import BaseModel

from alloy.errors import AlloyError, ErrorCode

if TYPE_CHECKING:
    from alloy.storage.artifacts import ArtifactStore
    from alloy.config import Settings
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

    def raise_for_failures(self) -> "DependencyReport":
        failures = self.failures
        if not failures:
            return self
        gpu_only = all(c.name == "GPU nodes" for c in failures)
        message = "dependency check failed: " + "; ".join(f"{c.name} at {c.target}: {c.detail}" for c in failures)
        raise AlloyError(
            ErrorCode.GPU_UNAVAILABLE if gpu_only else ErrorCode.SERVICE_UNAVAILABLE, message,
            {"failed": [c.name for c in failures], "checks": [c.model_dump() for c in self.checks]},
        )


class DependencyFailed(Exception):
    """Raised inside a check with the reason to report."""


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
    return DependencyCheck(name=name, target=target, ok=ok, duration_s=round(time.perf_counter() - started, 4),
                           detail=detail[:500])


# --- database ------------------------------------------------------------------------------------------------

def check_database(db: "Database") -> DependencyCheck:
    from sqlalchemy import text
    from sqlalchemy.engine import make_url

    def probe() -> str:
        with db.engine.connect() as connection:
            if connection.execute(text("SELECT 1")).scalar() != 1:
                raise DependencyFailed("SELECT 1 did not return 1")
        return f"SELECT 1 ok ({db.engine.dialect.name})"

    return _run("database", make_url(db.url).render_as_string(hide_password=True), probe)


# --- object store --------------------------------------------------------------------------------------------

def check_object_store(store: "ArtifactStore") -> DependencyCheck:
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
    checks = {"amqp": _check_amqp, "amqps": _check_amqp, "nats": _check_nats, "tls": _check_nats,
              "redis": _check_redis, "rediss": _check_redis}
    if scheme not in checks:
        return DependencyCheck(name="message queue", target=masked(url), ok=False, duration_s=0.0,
                               detail=f"unsupported scheme {scheme!r}: use amqp://, nats:// or redis://")
    return _run("message queue", masked(url), lambda: checks[scheme](url, timeout_s))


def _connect(url: str, default_port: int, timeout_s: float, *, tls: bool) -> socket.socket:
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or default_port
    try:
        sock = socket.create_connection((host, port), timeout=timeout_s)
    except OSError as exc:
        raise DependencyFailed(f"cannot connect to {host}:{port}: {exc.strerror or exc}") from None
    if tls:
        import ssl

        sock = ssl.create_default_context().wrap_socket(sock, server_hostname=host)
    sock.settimeout(timeout_s)
    return sock


def _recv_exact(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise DependencyFailed("the server closed the connection")
        data += chunk
    return data


# AMQP 0-9-1: frame = type(1) channel(2) size(4) payload frame-end(0xCE); a method payload starts with
# class-id(2) method-id(2). Connection class 10: Start 10, Start-Ok 11, Tune 30, Tune-Ok 31, Open 40,
# Open-Ok 41, Close 50, Close-Ok 51.
AMQP_HEADER = b"AMQP\x00\x00\x09\x01"
AMQP_FRAME_END = b"\xce"


def _shortstr(value: str) -> bytes:
    raw = value.encode()
    return struct.pack("B", len(raw)) + raw


def _longstr(raw: bytes) -> bytes:
    return struct.pack(">I", len(raw)) + raw


def _amqp_method(class_id: int, method_id: int, args: bytes) -> bytes:
    payload = struct.pack(">HH", class_id, method_id) + args
    return struct.pack(">BHI", 1, 0, len(payload)) + payload + AMQP_FRAME_END


def _amqp_read_method(sock: socket.socket) -> tuple[int, int, bytes]:
    while True:
        header = _recv_exact(sock, 7)
        if header.startswith(b"AMQP"):  # the server refused our protocol version and sent its own
            raise DependencyFailed("the server does not speak AMQP 0-9-1")
        frame_type, _channel, size = struct.unpack(">BHI", header)
        payload = _recv_exact(sock, size)
        if _recv_exact(sock, 1) != AMQP_FRAME_END:
            raise DependencyFailed("malformed AMQP frame")
        if frame_type == 1:
            class_id, method_id = struct.unpack(">HH", payload[:4])
            return class_id, method_id, payload[4:]
        # heartbeat (8) or other frames before the method we wait for: skip


def _amqp_close_reason(args: bytes) -> str:
    code = struct.unpack(">H", args[:2])[0]
    text = args[3:3 + args[2]].decode(errors="replace")
    return f"server closed the connection: {code} {text}"


def _amqp_expect(sock: socket.socket, method: tuple[int, int], step: str) -> bytes:
    class_id, method_id, args = _amqp_read_method(sock)
    if (class_id, method_id) == (10, 50):
        raise DependencyFailed(f"{step}: {_amqp_close_reason(args)}")
    if (class_id, method_id) != method:
        raise DependencyFailed(f"{step}: unexpected AMQP method {class_id}.{method_id}")
    return args


def _check_amqp(url: str, timeout_s: float) -> str:
    parts = urlsplit(url)
    user = unquote(parts.username or "guest")
    password = unquote(parts.password or "guest")
    vhost = unquote(parts.path[1:]) if parts.path and parts.path != "/" else "/"
    tls = parts.scheme.lower() == "amqps"
    with _connect(url, 5671 if tls else 5672, timeout_s, tls=tls) as sock:
        sock.sendall(AMQP_HEADER)
        _amqp_expect(sock, (10, 10), "handshake")
        # client-properties: {"capabilities": {"authentication_failure_close": true}} so a broker that supports
        # it (RabbitMQ) says *why* it refuses the login instead of just closing the socket.
        capabilities = _shortstr("authentication_failure_close") + b"t\x01"
        properties = _shortstr("capabilities") + b"F" + _longstr(capabilities) \
            + _shortstr("product") + b"S" + _longstr(b"alloy-dependency-check")
        start_ok = (_longstr(properties) + _shortstr("PLAIN")
                    + _longstr(b"\x00" + user.encode() + b"\x00" + password.encode()) + _shortstr("en_US"))
        sock.sendall(_amqp_method(10, 11, start_ok))
        try:
            tune = _amqp_expect(sock, (10, 30), "login")
        except DependencyFailed as exc:
            if "closed the connection" in str(exc) and "403" not in str(exc):
                raise DependencyFailed(f"login as {user!r} refused (the server closed the connection)") from None
            raise
        channel_max, frame_max, _heartbeat = struct.unpack(">HIH", tune[:8])
        sock.sendall(_amqp_method(10, 31, struct.pack(">HIH", channel_max, frame_max, 0)))
        sock.sendall(_amqp_method(10, 40, _shortstr(vhost) + _shortstr("") + b"\x00"))
        _amqp_expect(sock, (10, 41), f"open vhost {vhost!r}")
        sock.sendall(_amqp_method(10, 50, struct.pack(">H", 200) + _shortstr("alloy check done") + struct.pack(">HH", 0, 0)))
        try:
            _amqp_expect(sock, (10, 51), "close")
        except DependencyFailed:
            pass  # the check has already succeeded; a broker that drops the socket on Close is fine
    return f"AMQP 0-9-1 login as {user!r} and open of vhost {vhost!r} ok"


def _read_line(sock: socket.socket, limit: int = 64 * 1024) -> str:
    data = b""
    while not data.endswith(b"\r\n"):
        chunk = sock.recv(1)
        if not chunk:
            raise DependencyFailed("the server closed the connection")
        data += chunk
        if len(data) > limit:
            raise DependencyFailed("protocol line too long")
    return data[:-2].decode(errors="replace")


def _check_nats(url: str, timeout_s: float) -> str:
    parts = urlsplit(url)
    with _connect(url, 4222, timeout_s, tls=False) as sock:
        line = _read_line(sock)
        if not line.startswith("INFO "):
            raise DependencyFailed(f"not a NATS server (first line {line[:60]!r})")
        info = json.loads(line[5:])
        if parts.scheme.lower() == "tls" or info.get("tls_required"):
            raise DependencyFailed("the NATS server requires TLS, which this check does not negotiate")
        connect: dict[str, Any] = {"verbose": False, "pedantic": False, "name": "alloy-dependency-check",
                                   "lang": "python", "version": "0", "protocol": 1}
        if parts.username and parts.password is not None:
            connect.update(user=unquote(parts.username), **{"pass": unquote(parts.password)})
        elif parts.username:
            connect["auth_token"] = unquote(parts.username)
        sock.sendall(f"CONNECT {json.dumps(connect)}\r\nPING\r\n".encode())
        while True:
            reply = _read_line(sock)
            if reply == "PONG":
                break
            if reply.startswith("-ERR"):
                raise DependencyFailed(f"server refused the connection: {reply[5:].strip()}")
            # +OK or a server PING: keep reading
            if reply == "PING":
                sock.sendall(b"PONG\r\n")
    return f"NATS {info.get('version', '?')} CONNECT/PING ok"


def _check_redis(url: str, timeout_s: float) -> str:
    import redis

    client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
    try:
        if client.ping() is not True:
            raise DependencyFailed("PING did not answer PONG")
        version = client.info("server").get("redis_version", "?")
    except redis.exceptions.AuthenticationError as exc:
        raise DependencyFailed(f"authentication refused: {exc}") from None
    except redis.exceptions.ConnectionError as exc:
        raise DependencyFailed(f"cannot connect: {exc}") from None
    finally:
        client.close()
    return f"Redis {version} PING ok"


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
    settings: "Settings",
    *,
    db: "Database | None" = None,
    store: "ArtifactStore | None" = None,
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


def _database_check(settings: "Settings", db: "Database | None") -> DependencyCheck:
    from sqlalchemy.engine import make_url

    from alloy.storage.db import Database

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
        return DependencyCheck(name="database", target=target, ok=False, duration_s=0.0,
                               detail=f"{type(exc).__name__}: {exc}"[:500])
    try:
        return check_database(db)
    finally:
        db.close()


def _store_check(settings: "Settings", store: "ArtifactStore | None", timeout_s: float) -> DependencyCheck:
    """The store from the settings, with S3 timeouts and retries capped so an unreachable endpoint fails in
    seconds rather than after botocore's minutes of retries."""
    from alloy.storage.artifacts import ArtifactStore

    if store is not None:
        return check_object_store(store)
    options = dict(settings.storage_options)
    if settings.artifacts_uri.startswith("s3://"):
        options["config_kwargs"] = {"connect_timeout": timeout_s, "read_timeout": timeout_s,
                                    "retries": {"max_attempts": 1}}
    try:
        store = ArtifactStore(settings.artifacts_uri, options)
    except Exception as exc:  # noqa: BLE001
        return DependencyCheck(name="object store", target=masked(settings.artifacts_uri), ok=False,
                               duration_s=0.0, detail=f"{type(exc).__name__}: {exc}"[:500])
    return check_object_store(store)
