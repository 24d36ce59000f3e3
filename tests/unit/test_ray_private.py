"""Every private Ray symbol alloy.control.ray_private reaches for still exists in the installed Ray: an upgrade
that moves one fails here, by name, instead of in a running cluster."""

from __future__ import annotations

import importlib
import sys

import pytest

from alloy.control import ray_private


@pytest.mark.parametrize(
    "module, name",
    [
        ("ray._raylet", "AuthenticationTokenLoader"),
        ("ray._raylet", "Config"),
        ("ray._raylet", "GcsClient"),
        ("ray.serve._private.api", "serve_start"),
        ("ray.core.generated.autoscaler_pb2", "DrainNodeReason"),
        ("ray._private.auto_init_hook", "enable_auto_connect"),
        ("ray.serve._private.router", "SingletonThreadRouter"),
    ],
)
def test_the_private_symbol_exists(module, name):
    assert hasattr(importlib.import_module(module), name)


def test_the_drain_reason_we_send_exists():
    from ray.core.generated import autoscaler_pb2

    assert autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION") > 0


def test_refreshing_the_auth_cache_works_once_ray_is_loaded(monkeypatch):
    import ray._raylet  # noqa: F401 - the refresh only acts once this is loaded

    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    monkeypatch.setenv("RAY_AUTH_TOKEN", "0" * 64)
    ray_private.refresh_auth_token_cache()
    assert "ray._raylet" in sys.modules


def test_the_router_loop_stop_disables_auto_connect():
    from ray._private import auto_init_hook

    before = auto_init_hook.enable_auto_connect
    try:
        ray_private.stop_serve_router_loop()
        assert auto_init_hook.enable_auto_connect is False
    finally:
        auto_init_hook.enable_auto_connect = before
