"""Which external services (PostgreSQL, Redis, RabbitMQ, NATS) a test needs, and what happens without them.

A missing service skips the test with a reason, so the tiers run anywhere; with ``ALLOY_REQUIRE_SERVICES=1``
(``make test``, CI) a missing service fails the test instead, so a broken CI machine can never pass by skipping.
"""

from __future__ import annotations

import os
import socket

import pytest

REQUIRED = os.environ.get("ALLOY_REQUIRE_SERVICES") == "1"


def service_missing(name: str, reason: str) -> None:
    """Skip (or, when services are required, fail) the current test because ``name`` is unavailable."""
    if REQUIRED:
        pytest.fail(f"{name} is required (ALLOY_REQUIRE_SERVICES=1) but unavailable: {reason}", pytrace=False)
    pytest.skip(f"{name} unavailable: {reason}")


def require_port(name: str, host: str, port: int, timeout_s: float = 2.0) -> None:
    """Skip/fail unless something accepts TCP connections at ``host:port``."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return
    except OSError as exc:
        service_missing(name, f"nothing answers at {host}:{port} ({exc.strerror or exc})")


def require_redis() -> None:
    require_port("Redis", "127.0.0.1", 6379)


def require_rabbitmq() -> None:
    require_port("RabbitMQ", "127.0.0.1", 5672)


def require_nats() -> None:
    require_port("NATS", "127.0.0.1", 4222)
