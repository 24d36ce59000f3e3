"""The nodes of the connected Ray cluster: which are alive and draining, Ray's own drain API, and worker nodes we
start ourselves (``ray start --address``: a multi-node cluster on one machine for the tests and the scale bench,
or a worker joining a head by hand).

A worker node gets its own temp dir, ports from the free range, custom resources (how engine replicas are placed
on workers, as ``num_gpus`` places them on GPU nodes) and its own environment, which every worker process of
the node inherits (``ALLOY_DATA_DIR``: the node-local model cache and scratch). It is stopped, or killed outright,
by the process ids it started, never with ``ray stop``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import ray

from alloy.control import ray_private
from alloy.control.ports import WORKER_PORT_SPAN, pick_port_block
from alloy.control.ray_head import RayHead, node_resource_args, stop_process_tree
from alloy.errors import AlloyError, ErrorCode
from alloy.http_port import port_is_free
from alloy.merge.allocator import TORCH_ENV

HEAD_RESOURCE = "node:__internal_head__"  # Ray's own marker resource of the head node
WORKER_PORT_FLAGS = (
    "node-manager-port",
    "object-manager-port",
    "metrics-export-port",
    "dashboard-agent-listen-port",
    "dashboard-agent-grpc-port",
    "runtime-env-agent-port",
)


def alive_ray_nodes() -> list[dict[str, Any]]:
    return [node for node in ray.nodes() if node.get("Alive")]


def draining_node_ids() -> set[str]:
    """The alive nodes the GCS is draining (``POST /admin/drain``, ``ray drain-node``, the autoscaler)."""
    return set(ray_private.draining_nodes(ray.get_runtime_context().gcs_address))


def this_node_draining() -> bool:
    """Whether the node this process runs on is being drained: its work must not start anything new."""
    return ray.get_runtime_context().get_node_id() in draining_node_ids()


def drain_ray_node(node_id: str | None, reason: str, deadline_s: int | None) -> tuple[str, bool, str]:
    """Ask the GCS to drain a node (Ray's own drain API, as ``ray drain-node`` and autoscaler v2 use it): no new
    tasks or actors are scheduled there and running ones finish. The head node cannot be drained; without a
    node id the only worker node is chosen. Returns (node_id, accepted, message)."""
    nodes = alive_ray_nodes()
    if node_id is None:
        workers = [n for n in nodes if HEAD_RESOURCE not in (n.get("Resources") or {})]
        if len(workers) != 1:
            raise AlloyError(
                ErrorCode.CONFLICT if not workers else ErrorCode.VALIDATION_FAILED,
                "no worker node to drain (the head node cannot be drained)"
                if not workers
                else f"{len(workers)} worker nodes: name one with node_id",
                {"workers": [n["NodeID"] for n in workers]},
            )
        node_id = workers[0]["NodeID"]
    else:
        node = next((n for n in nodes if n["NodeID"] == node_id), None)
        if node is None:
            raise AlloyError(
                ErrorCode.NOT_FOUND, f"node {node_id!r} is not an alive node of this cluster", {"node_id": node_id}
            )
        if HEAD_RESOURCE in (node.get("Resources") or {}):
            raise AlloyError(
                ErrorCode.CONFLICT,
                "the head node cannot be drained (it runs the GCS and the proxy)",
                {"node_id": node_id},
            )
    deadline_ms = int(time.time() * 1000) + deadline_s * 1000 if deadline_s else 0
    accepted, message = ray_private.drain_node(ray.get_runtime_context().gcs_address, node_id, reason, deadline_ms)
    return node_id, accepted, message


def cluster_gpu_count() -> float:
    """The GPUs of the connected Ray cluster: the one probe behind the start's GPU check and the ingress's
    job-admission check."""
    return float(ray.cluster_resources().get("GPU", 0))


# -- worker nodes we start -------------------------------------------------------------------------------------


@dataclass
class RayWorkerNode:
    """A worker node we started: ``ray start --address ... --block`` in its own process group."""

    name: str
    process: subprocess.Popen
    temp_dir: Path
    ports: dict[str, int]
    resources: dict[str, float]
    env: dict[str, str]

    @property
    def node_manager_port(self) -> int:
        return self.ports["node-manager-port"]

    def pids(self) -> list[int]:
        """The ``ray start`` process and every descendant: the raylet, its agents and its worker processes."""
        try:
            root = psutil.Process(self.process.pid)
            return [root.pid] + [child.pid for child in root.children(recursive=True)]
        except psutil.Error:
            return []

    def kill(self) -> list[int]:
        """Kill the node outright (``kill -9`` of the processes it started: a machine lost, not a shutdown)."""
        pids = self.pids()
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                continue
        self.process.wait(timeout=10)
        _wait_gone(pids, timeout_s=10.0)  # SIGKILL is delivered asynchronously: return once they are all dead
        return pids

    def stop(self, timeout_s: float = 30.0) -> None:
        stop_process_tree(self.process, timeout_s=timeout_s)


def start_ray_worker(
    head: RayHead,
    name: str,
    temp_dir: str | Path,
    *,
    num_cpus: int,
    resources: dict[str, float] | None = None,
    object_store_bytes: int | None = None,
    env: dict[str, str] | None = None,
    ready_timeout_s: float = 120.0,
) -> RayWorkerNode:
    """Start a worker node joining ``head`` (token auth: the head's token) with ports from the free range."""
    temp_dir = Path(temp_dir)
    temp_dir.mkdir(parents=True, exist_ok=True)
    block = pick_port_block(len(WORKER_PORT_FLAGS), span_after=WORKER_PORT_SPAN)
    ports = dict(zip(WORKER_PORT_FLAGS, block))
    command = [
        str(Path(sys.executable).with_name("ray")),
        "start",
        "--address",
        head.address,
        "--block",
        "--node-ip-address",
        "127.0.0.1",
        "--temp-dir",
        str(temp_dir),
        "--num-cpus",
        str(num_cpus),
        "--min-worker-port",
        str(block[len(WORKER_PORT_FLAGS)]),
        "--max-worker-port",
        str(block[-1]),
        "--disable-usage-stats",
        *node_resource_args(resources, object_store_bytes),
    ]
    for flag, port in ports.items():
        command += [f"--{flag}", str(port)]
    node_env = dict(env or {})
    log = open(temp_dir / f"ray-{name}.log", "ab")
    process = subprocess.Popen(
        command,
        env={**TORCH_ENV, **os.environ, **node_env, **head.env, "RAY_USAGE_STATS_ENABLED": "0"},
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    node = RayWorkerNode(name, process, temp_dir, ports, dict(resources or {}), node_env)
    deadline = time.monotonic() + ready_timeout_s
    while port_is_free(ports["node-manager-port"]):
        if process.poll() is not None or time.monotonic() > deadline:
            node.stop()
            tail = (temp_dir / f"ray-{name}.log").read_text(errors="replace")[-2000:]
            raise AlloyError(ErrorCode.SERVICE_UNAVAILABLE, f"worker node {name} did not start:\n{tail}")
        time.sleep(0.3)
    return node


def _wait_gone(pids: list[int], timeout_s: float) -> None:
    """Until every process in ``pids`` has exited (a zombie awaiting its parent counts as gone)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        alive = []
        for pid in pids:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
            except psutil.NoSuchProcess:
                continue
        if not alive:
            return
        time.sleep(0.05)
