"""What the route handlers reach through ``request.app.state``: one :class:`ApiContext` per FastAPI app.

Routers written elsewhere (``serve_app/routes_evolutions.py``) use the two dependency helpers below and nothing
else, so they work the same in the Serve ingress and in a plain FastAPI app:

- ``api_context(request) -> ApiContext`` (settings, job store, public base URL, metrics, cluster-state gate;
  ``await ctx.create_job(kind, request, owner)`` writes a job behind the cluster-state gate);
- ``component(name)`` -> a FastAPI dependency returning the deployment handle of ``name`` (``"EvolutionEngine"``,
  ``"MergeEngine"``, ...), or 503 SERVICE_UNAVAILABLE when the app runs without it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from alloy.config import ConfigHolder
from alloy.errors import AlloyError, ErrorCode
from alloy.jobs.records import JobKind, JobRecord
from alloy.jobs.store import Guard


@dataclass
class ApiContext:
    config: ConfigHolder
    services: Any  # deployments.runtime.Services (db, jobs, ... opened lazily)
    handles: dict[str, Any] = field(default_factory=dict)
    public_url: str | None = None
    profile: str = "cpu"
    gpu_on_demand: bool = False
    metrics: Any = None
    gpu_probe: Callable[[], float] | None = None
    # The 503 gate on the cluster lifecycle state (alloy.cluster.state.CachedClusterState); None lets every
    # request through (a plain FastAPI app outside the cluster, e.g. the uvicorn benchmark).
    cluster_gate: Any = None
    _gpu_cache: tuple[float, float] = (0.0, -1.0)

    def base_url(self, request: Request) -> str:
        return (self.public_url or self.config.settings.server.public_url or str(request.base_url)).rstrip("/")

    def url_for_job(self, request: Request, job_id: str) -> str:
        return f"{self.base_url(request)}/jobs/{job_id}"

    def handle(self, name: str):
        handle = self.handles.get(name)
        if handle is None:
            raise AlloyError(
                ErrorCode.SERVICE_UNAVAILABLE, f"{name} is not deployed in this application", {"component": name}
            )
        return handle

    def gpus(self) -> float:
        """GPUs in the cluster right now (cached for 5 s: it is asked on every job submission)."""
        if self.gpu_probe is None:
            return 0.0
        value, at = self._gpu_cache
        if time.monotonic() - at > 5.0:
            value = float(self.gpu_probe())
            self._gpu_cache = (value, time.monotonic())
        return value

    def submission_guards(self) -> list[Guard]:
        """The job-creation guards of this app: the uncached cluster-state check, in the job's own transaction
        (``JobStore.create``), so that nothing is accepted once DRAINING begins. None outside the cluster."""
        return [] if self.cluster_gate is None else [self.cluster_gate.submission_guard]

    async def create_job(
        self, kind: JobKind, request: dict[str, Any], owner: str | None, *, output_model_id: str | None = None
    ) -> JobRecord:
        """Write a CREATED job behind :meth:`submission_guards` (off the event loop)."""
        return await asyncio.to_thread(
            self.services.jobs.create,
            kind,
            request,
            owner,
            output_model_id=output_model_id,
            guards=self.submission_guards(),
        )

    def require_gpu_capacity(self) -> None:
        """GPU profile: refuse job creation with GPU_UNAVAILABLE (503) while the cluster has no GPU, unless the
        cluster autoscales GPU nodes on demand (then the job waits for one)."""
        if self.profile != "gpu" or self.gpu_on_demand:
            return
        if self.gpus() <= 0:
            raise AlloyError(
                ErrorCode.GPU_UNAVAILABLE,
                "the GPU profile is active but the cluster has no GPU",
                {"profile": "gpu", "cluster_gpus": 0},
            )


def api_context(request: Request) -> ApiContext:
    return request.app.state.ctx


def component(name: str) -> Callable[[Request], Any]:
    def dependency(request: Request) -> Any:
        return api_context(request).handle(name)

    dependency.__name__ = f"{name}_handle"
    return dependency
