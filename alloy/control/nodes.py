"""Node drain through Ray's own drain API, and the alive nodes of the connected cluster."""

from __future__ import annotations

import time
from typing import Any

import ray

from alloy.control import ray_private
from alloy.errors import AlloyError, ErrorCode


def alive_ray_nodes() -> list[dict[str, Any]]:
    return [node for node in ray.nodes() if node.get("Alive")]


def drain_ray_node(node_id: str | None, reason: str, deadline_s: int | None) -> tuple[str, bool, str]:
    """Ask the GCS to drain a node (Ray's own drain API, as ``ray drain-node`` and autoscaler v2 use it): no new
    tasks or actors are scheduled there and running ones finish. The head node cannot be drained; without a
    node id the only worker node is chosen. Returns (node_id, accepted, message)."""
    nodes = alive_ray_nodes()
    if node_id is None:
        workers = [n for n in nodes if "node:__internal_head__" not in (n.get("Resources") or {})]
        if len(workers) != 1:
            raise AlloyError(
                ErrorCode.CONFLICT if not workers else ErrorCode.VALIDATION_FAILED,
                "no worker node to drain (the head node cannot be drained)"
                if not workers
                else f"{len(workers)} worker nodes: name one with node_id",
                {"workers": [n["NodeID"] for n in workers]},
            )
        node_id = workers[0]["NodeID"]
    elif node_id not in {n["NodeID"] for n in nodes}:
        raise AlloyError(
            ErrorCode.NOT_FOUND, f"node {node_id!r} is not an alive node of this cluster", {"node_id": node_id}
        )
    deadline_ms = int(time.time() * 1000) + deadline_s * 1000 if deadline_s else 0
    accepted, message = ray_private.drain_node(ray.get_runtime_context().gcs_address, node_id, reason, deadline_ms)
    return node_id, accepted, message


def cluster_gpu_count() -> float:
    """The GPUs of the connected Ray cluster: the one probe behind the start's GPU check and the ingress's
    job-admission check."""
    return float(ray.cluster_resources().get("GPU", 0))
