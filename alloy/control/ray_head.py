"""Starting and stopping a local Ray head and deploying the Serve app on it.

Shared by ``alloy start`` and the test fixtures so that both follow one port discipline: every port Ray opens is
chosen from a free range that stays clear of the ports other software on a shared machine expects (6379, 8000,
8265, 10002-19999), and the head is stopped by the process ids it started, never by ``ray stop`` (which kills
every Ray process on the machine).

Token authentication: Ray 2.5x+ enables token auth for new clusters when ``RAY_AUTH_MODE`` is unset and a token
file exists. We make it explicit: ``RAY_AUTH_MODE=token`` and a freshly generated ``RAY_AUTH_TOKEN`` in the
environment of the head and of every driver that connects (``RayHead.env``), so nothing is written to
``~/.ray/auth_token`` and two clusters on one machine never share a token.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from alloy.control import ray_private
from alloy.control.ports import WORKER_PORT_SPAN, pick_port_block
from alloy.errors import AlloyError, ErrorCode
from alloy.http_port import port_is_free
from alloy.merge.allocator import TORCH_ENV

RAY_PORT_FLAGS = (
    "port",
    "ray-client-server-port",
    "dashboard-port",
    "dashboard-agent-listen-port",
    "dashboard-agent-grpc-port",
    "metrics-export-port",
    "runtime-env-agent-port",
    "node-manager-port",
    "object-manager-port",
)


@dataclass
class RayHead:
    """A running local Ray head started by us."""

    address: str
    ports: dict[str, int]
    http_port: int
    temp_dir: Path
    env: dict[str, str]
    process: subprocess.Popen | None = None
    pid_file: Path | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def dashboard_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['dashboard-port']}"

    def apply_env(self) -> None:
        """Make this process a client of this head (token auth included)."""
        os.environ.update(self.env)
        ray_private.refresh_auth_token_cache()


# Serve settings of every head we start (an operator's own environment wins). WHY: the HTTP proxy forwards each
# request to the ingress replica over Serve's gRPC channel instead of a Ray actor call; measured with
# bench/http_bench.py on 2 vCPUs, the progress poll's p50 through the proxy went from 75-78 ms to 57-61 ms (x2.21-2.49
# the plain FastAPI app before, x1.77-2.05 after), p99 and throughput better too. Only the proxy reads it; handles
# between deployments keep their default transport.
SERVE_ENV = {"RAY_SERVE_PROXY_USE_GRPC": "1"}
# Every node we start also passes TORCH_ENV to its workers (they merge: alloy.merge.allocator).


def auth_env(token: str | None = None) -> dict[str, str]:
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token or secrets.token_hex(32)}


def start_ray_head(
    temp_dir: str | Path,
    *,
    num_cpus: int = 8,
    num_gpus: int | None = None,
    include_dashboard: bool = True,
    ready_timeout_s: float = 120.0,
    log_file: Path | None = None,
    resources: dict[str, float] | None = None,
    object_store_bytes: int | None = None,
    extra_env: dict[str, str] | None = None,
) -> RayHead:
    """Start ``ray start --head --block`` in its own process group with every port from the free range.

    ``temp_dir`` should be short: Ray puts unix sockets under it and socket paths are limited to ~107 bytes.
    ``resources`` (custom resources), ``object_store_bytes`` and ``extra_env`` (inherited by every worker process
    of the node) are what a multi-node set-up gives each node of its own (:mod:`alloy.control.nodes`).
    """
    temp_dir = Path(temp_dir)
    temp_dir.mkdir(parents=True, exist_ok=True)
    ports_block = pick_port_block(len(RAY_PORT_FLAGS) + 1, span_after=WORKER_PORT_SPAN)
    ports = dict(zip(RAY_PORT_FLAGS, ports_block))
    http_port = ports_block[len(RAY_PORT_FLAGS)]
    worker_min = ports_block[len(RAY_PORT_FLAGS) + 1]
    worker_max = ports_block[-1]

    env = auth_env()
    command = [
        str(Path(sys.executable).with_name("ray")),
        "start",
        "--head",
        "--block",
        "--node-ip-address",
        "127.0.0.1",
        "--temp-dir",
        str(temp_dir),
        "--num-cpus",
        str(num_cpus),
        "--include-dashboard",
        "true" if include_dashboard else "false",
        "--dashboard-host",
        "127.0.0.1",
        "--min-worker-port",
        str(worker_min),
        "--max-worker-port",
        str(worker_max),
        "--disable-usage-stats",
    ]
    if num_gpus is not None:
        command += ["--num-gpus", str(num_gpus)]
    command += node_resource_args(resources, object_store_bytes)
    for flag, port in ports.items():
        command += [f"--{flag}", str(port)]

    child_env = {**SERVE_ENV, **TORCH_ENV, **os.environ, **(extra_env or {}), **env, "RAY_USAGE_STATS_ENABLED": "0"}
    output = open(log_file or temp_dir / "ray-head.log", "ab")
    process = subprocess.Popen(command, env=child_env, stdout=output, stderr=subprocess.STDOUT, start_new_session=True)
    head = RayHead(
        address=f"127.0.0.1:{ports['port']}",
        ports=ports,
        http_port=http_port,
        temp_dir=temp_dir,
        env=env,
        process=process,
    )
    try:
        _wait_for_gcs(head, ready_timeout_s)
    except BaseException:
        stop_ray_head(head)
        raise
    return head


def node_resource_args(resources: dict[str, float] | None, object_store_bytes: int | None) -> list[str]:
    """``ray start`` flags for a node's custom resources and object store size (head and worker nodes alike)."""
    args = ["--resources", json.dumps(resources)] if resources else []
    if object_store_bytes is not None:
        args += ["--object-store-memory", str(object_store_bytes)]
    return args


def _wait_for_gcs(head: RayHead, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if head.process is not None and head.process.poll() is not None:
            log = head.temp_dir / "ray-head.log"
            tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
            raise AlloyError(ErrorCode.SERVICE_UNAVAILABLE, f"ray start exited early:\n{tail}")
        # The raylet registers after the GCS; its port answering means the node is usable.
        if not port_is_free(head.ports["port"]) and not port_is_free(head.ports["node-manager-port"]):
            return
        time.sleep(0.5)
    raise AlloyError(ErrorCode.SERVICE_UNAVAILABLE, f"ray head did not come up in {timeout_s:.0f}s")


def _descendants(pid: int) -> list[int]:
    try:
        return [child.pid for child in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return []


def stop_ray_head(head: RayHead, *, timeout_s: float = 30.0) -> None:
    """Stop exactly the processes of this head: the ``ray start`` process, its descendants, its process group."""
    if head.process is not None:
        stop_process_tree(head.process, timeout_s=timeout_s)


def stop_process_tree(process: subprocess.Popen, *, timeout_s: float = 30.0) -> None:
    """Stop a ``ray start --block`` process we started (head or worker node), its descendants and its process
    group; never anything else."""
    root = process.pid
    tree = _descendants(root)
    # ray start --block tears down its own node on SIGTERM; give it the chance first.
    try:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=timeout_s)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    survivors = []
    for pid in tree + _descendants(root):
        try:
            proc = psutil.Process(pid)
            proc.kill()
            survivors.append(proc)
        except psutil.Error:
            continue
    psutil.wait_procs(survivors, timeout=10)
    try:
        os.killpg(root, signal.SIGKILL)  # the process group we created with start_new_session
    except (ProcessLookupError, PermissionError):
        pass
    if process.poll() is None:
        process.kill()
        process.wait(timeout=10)
