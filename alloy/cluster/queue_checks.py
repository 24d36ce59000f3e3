"""Message-queue checks through each broker's own client library, each bounded by a timeout.

Each function logs in (credentials and vhost from the URL), proves the connection works, closes it, and returns
what it saw; a refusal raises :class:`DependencyFailed` with the broker's reason (never the password).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Any, cast
from urllib.parse import urlsplit

import nats
import pika
import pika.exceptions
import redis


class DependencyFailed(Exception):
    """Raised inside a check with the reason to report."""


def _where(url: str, default_port: int) -> str:
    parts = urlsplit(url)
    return f"{parts.hostname or '127.0.0.1'}:{parts.port or default_port}"


def check_amqp(url: str, timeout_s: float) -> str:
    """Open an AMQP 0-9-1 connection (login + vhost open) with pika and close it."""
    params = pika.URLParameters(url)
    params.socket_timeout = params.stack_timeout = params.blocked_connection_timeout = timeout_s
    params.connection_attempts = 1
    try:
        connection = pika.BlockingConnection(params)
    except (pika.exceptions.ProbableAuthenticationError, pika.exceptions.ProbableAccessDeniedError) as exc:
        raise DependencyFailed(f"login refused: {exc}") from None  # the broker's reason: ACCESS_REFUSED, vhost
    except pika.exceptions.AMQPConnectionError as exc:
        raise DependencyFailed(f"cannot connect to {_where(url, 5672)}: {exc or type(exc).__name__}") from None
    connection.close()
    return f"AMQP 0-9-1 login as {params.credentials.username!r} and open of vhost {params.virtual_host!r} ok"


def check_nats(url: str, timeout_s: float) -> str:
    """CONNECT (with the URL's user/password or token) and a flush round trip with nats-py."""
    # nats-py is asyncio-only; a private loop in a worker thread keeps this callable from any context.
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, _nats_round_trip(url, timeout_s)).result()


async def _nats_round_trip(url: str, timeout_s: float) -> str:
    errors: list[Exception] = []

    async def record(error: Exception) -> None:
        errors.append(error)

    try:
        # connect_timeout bounds one attempt only; wait_for bounds the whole connect (a silent port would hang).
        client = await asyncio.wait_for(
            nats.connect(
                url,
                connect_timeout=timeout_s,
                allow_reconnect=False,
                max_reconnect_attempts=0,
                error_cb=record,
                name="alloy-dependency-check",
            ),
            timeout_s,
        )
    except asyncio.TimeoutError:
        reason = (
            f"{type(errors[-1]).__name__}: {errors[-1]}"
            if errors
            else "timed out waiting for the server's answer (wrong port or protocol?)"
        )
        raise DependencyFailed(f"cannot connect to {_where(url, 4222)}: {reason}") from None
    except nats.errors.Error as exc:
        raise DependencyFailed(f"server refused the connection: {exc}") from None
    try:
        await client.flush(timeout=max(1, round(timeout_s)))  # nats-py takes whole seconds
        return f"NATS {client.connected_server_version} CONNECT/PING ok"
    finally:
        await client.close()


def check_redis(url: str, timeout_s: float) -> str:
    """PING through redis-py, AUTH and db from the URL."""
    client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
    try:
        if client.ping() is not True:
            raise DependencyFailed("PING did not answer PONG")
        info = cast(dict[str, Any], client.info("server"))  # the sync client: a dict, not an awaitable
        version = info.get("redis_version", "?")
    except redis.exceptions.AuthenticationError as exc:
        raise DependencyFailed(f"authentication refused: {exc}") from None
    except redis.exceptions.ConnectionError as exc:
        raise DependencyFailed(f"cannot connect: {exc}") from None
    finally:
        client.close()
    return f"Redis {version} PING ok"


__all__ = ["DependencyFailed", "check_amqp", "check_nats", "check_redis"]
