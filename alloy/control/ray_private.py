"""Every call into Ray's private (underscore) APIs, in one place.

Ray does not promise these across versions; keeping them behind this seam means a Ray upgrade breaks one module
and its tests (``tests/unit/test_ray_private.py``, ``tests/integration/test_ray_private_cluster.py``), not
callers scattered through the tree. Each function does one private call and nothing else.
"""

from __future__ import annotations

import sys
from typing import Any


def refresh_auth_token_cache() -> None:
    """Ray caches the auth mode and token when ``ray._raylet`` is imported; after the environment changed
    (``RAY_AUTH_MODE``/``RAY_AUTH_TOKEN``) refresh both, config first (as Ray's own test utilities do), or an
    already-imported ray keeps connecting without the token. No-op while ``ray._raylet`` is not loaded."""
    if "ray._raylet" not in sys.modules:
        return
    # lazy: private Ray API, resolved only when called (see the module docstring)
    from ray._raylet import AuthenticationTokenLoader, Config  # type: ignore[attr-defined]  # compiled, no stubs

    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


def start_serve_client(http_options: dict[str, Any]) -> Any:
    """Start Serve (controller + proxies) and return its client: the only way to apply a whole
    ``ServeDeploySchema`` from Python, which is what ``serve run config.yaml`` does."""
    # lazy: private Ray API, resolved only when called (see the module docstring)
    from ray.serve._private.api import serve_start

    return serve_start(http_options=http_options)


def drain_node(gcs_address: str, node_id: str, reason: str, deadline_ms: int) -> tuple[bool, str]:
    """Ask the GCS to drain ``node_id`` with reason PREEMPTION (as ``ray drain-node`` does); returns
    (accepted, rejection message)."""
    # lazy: private Ray API, resolved only when called (see the module docstring)
    from ray._raylet import GcsClient  # type: ignore[attr-defined]  # compiled, no stubs
    from ray.core.generated import autoscaler_pb2

    gcs = GcsClient(address=gcs_address)
    accepted, message = gcs.drain_node(
        node_id,
        autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"),  # type: ignore[attr-defined]
        reason,
        deadline_ms,
    )
    return bool(accepted), message or ""


def draining_nodes(gcs_address: str) -> dict[str, int]:
    """The nodes the GCS is draining (node id hex -> deadline in ms, 0 for none), as Serve's controller reads
    them to migrate replicas off a draining node."""
    # lazy: private Ray API, resolved only when called (see the module docstring)
    from ray._raylet import GcsClient  # type: ignore[attr-defined]  # compiled, no stubs

    return {
        str(node_id): int(deadline) for node_id, deadline in GcsClient(address=gcs_address).get_draining_nodes().items()
    }


def stop_serve_router_loop() -> None:
    """DeploymentHandles used from a driver run Serve's router on a daemon thread whose metrics task keeps calling
    Ray; after ``ray.shutdown()`` those calls would auto-connect to a cluster being stopped, block for 60 s and
    abort the process. Stop that loop and keep Ray from auto-connecting again in this process."""
    # lazy: private Ray API, resolved only when called (see the module docstring)
    from ray._private import auto_init_hook
    from ray.serve._private.router import SingletonThreadRouter

    loop = SingletonThreadRouter._asyncio_loop
    if loop is not None and loop.is_running():
        loop.call_soon_threadsafe(loop.stop)
    auto_init_hook.enable_auto_connect = False
