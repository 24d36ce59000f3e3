"""alloy.control.ray_private against the session's real Ray cluster: the calls that need one. (``drain_node`` is
not called here: the GCS accepts draining the head node, which would take the session cluster down; its symbols
are checked in tests/unit/test_ray_private.py and the route in tests/e2e/test_serve_ops.py.)"""

from __future__ import annotations

import pytest

from alloy.control import ray_private

pytestmark = pytest.mark.ray


def test_the_serve_client_starts_on_the_cluster(ray_cluster):
    client = ray_private.start_serve_client({"host": "127.0.0.1", "port": ray_cluster.http_port})
    assert hasattr(client, "deploy_apps")
