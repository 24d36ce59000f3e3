"""The HTTP port of ``alloy start``: stable across starts, so ``ALLOY_URL`` and bookmarks keep working.

``--port`` (or ``server.port`` in the config, default 8470) is used; an explicit ``--port`` that is busy or
reserved is refused, while the default falls back to a free port from Ray's block (and says so)."""

from __future__ import annotations

import socket

from alloy.errors import AlloyError, ErrorCode

DEFAULT_HTTP_PORT = 8470
# Taken on this machine and the spec's deployment: Redis, Ray's dashboard, the Serve default, Ray's worker range.
RESERVED_PORTS = frozenset({6379, 8000, 8265}) | frozenset(range(10002, 20000))


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True


def choose_http_port(requested: int | None, configured: int) -> int | None:
    """The port to serve on, or None: let the caller fall back to a free one (only when none was asked for)."""
    if requested is not None:
        if requested in RESERVED_PORTS:
            raise AlloyError(
                ErrorCode.VALIDATION_FAILED,
                f"port {requested} is reserved (6379, 8000, 8265, 10002-19999); choose another",
                {"field": "port"},
            )
        if not port_is_free(requested):
            raise AlloyError(
                ErrorCode.CONFLICT,
                f"port {requested} is in use; choose another with --port",
                {"field": "port", "port": requested},
            )
        return requested
    if configured not in RESERVED_PORTS and port_is_free(configured):
        return configured
    return None
