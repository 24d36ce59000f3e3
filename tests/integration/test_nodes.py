"""alloy.control.nodes against the session's real (single-node) Ray cluster: the draining state read from the
GCS, and the drain requests refused before they reach it (the GCS would accept draining the head). Draining a
real worker node is in tests/e2e/test_multinode_cluster.py."""

from __future__ import annotations

import pytest
import ray

from alloy.control.nodes import alive_ray_nodes, drain_ray_node, draining_node_ids, this_node_draining
from alloy.errors import AlloyError, ErrorCode

pytestmark = pytest.mark.ray


def test_nothing_is_draining(ray_cluster):
    assert draining_node_ids() == set()
    assert this_node_draining() is False


def test_the_head_is_never_drained(ray_cluster):
    head = ray.get_runtime_context().get_node_id()
    assert [n["NodeID"] for n in alive_ray_nodes()] == [head]
    for node_id in (None, head):
        with pytest.raises(AlloyError) as refused:
            drain_ray_node(node_id, "test", None)
        assert refused.value.code is ErrorCode.CONFLICT and "head node cannot be drained" in refused.value.message
    with pytest.raises(AlloyError) as unknown:
        drain_ray_node("f" * 56, "test", None)
    assert unknown.value.code is ErrorCode.NOT_FOUND
    assert draining_node_ids() == set()
