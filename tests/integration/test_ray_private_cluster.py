"""alloy.control.ray_private against the session's real Ray cluster: the calls that need one."""

from __future__ import annotations

import pytest

from alloy.control import ray_private

pytestmark = pytest.mark.ray


def test_the_gcs_refuses_to_drain_the_head_node(ray_cluster):
    import ray

    head = next(n for n in ray.nodes() if n.get("Alive") and "node:__internal_head__" in n["Resources"])
    accepted, message = ray_private.drain_node(
        ray.get_runtime_context().gcs_address, head["NodeID"], "test: the head cannot be drained", 0
    )
    assert accepted is False and message


def test_the_serve_client_starts_on_the_cluster(ray_cluster):
    client = ray_private.start_serve_client({"host": "127.0.0.1", "port": ray_cluster.http_port})
    assert hasattr(client, "deploy_apps")
