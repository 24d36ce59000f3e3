"""Scratch: harness smoke."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.ray, pytest.mark.postgres]


def test_health_lists_every_node(multinode):
    health = multinode.service.client("read").get("/health")
    assert health.status_code == 200, health.text
    body = health.json()
    print(multinode.timings, body["nodes"], body["components"].keys())
    assert {n["node_id"] for n in body["nodes"] if n["alive"]} == set(multinode.node_ids.values())
