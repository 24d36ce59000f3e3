"""Operations routes: health, Prometheus metrics, and the admin actions (reload, drain, flush, cache clear).

/health and /metrics answer in every cluster state (they are not behind the cluster-state gate).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import ray
from fastapi import APIRouter, Request, Response

from alloy import components as c
from alloy.cluster.state import ClusterStateStore
from alloy.control.nodes import drain_ray_node
from alloy.errors import AlloyError, ErrorCode
from alloy.jobs.records import JobKind, JobState
from alloy.jobs.store import JobStore
from deployments._calls import call
from serve_app import schemas as s
from serve_app.context import ApiContext, api_context
from serve_app.metrics import CONTENT_TYPE_LATEST
from serve_app.routing import scope as _scope

logger = logging.getLogger("alloy.api")

COMPONENTS = c.BACKENDS
HEALTH_TIMEOUT_S = 5.0
CACHED_ENGINES = (c.MERGE_ENGINE, c.EVALUATION_ENGINE)  # the engines with a model cache


# --- health, metrics, admin ---------------------------------------------------------------------------------
ops_router = APIRouter(tags=["operations"])


async def _component_health(ctx: ApiContext, name: str) -> s.ComponentHealth:
    handle = ctx.handles.get(name)
    if handle is None:
        return s.ComponentHealth(status="absent")
    try:
        detail = await call(handle, "health", timeout_s=HEALTH_TIMEOUT_S)
        return s.ComponentHealth(status="healthy", detail=detail if isinstance(detail, dict) else None)
    except Exception as exc:  # noqa: BLE001 - reported, not raised: health shows what is broken
        return s.ComponentHealth(status="unhealthy", detail={"error": _unhealthy(name, exc)})


@ops_router.get(
    "/health",
    response_model=s.HealthView,
    dependencies=_scope("read"),
    summary="Cluster state and the health of every component",
)
async def health(request: Request) -> s.HealthView:
    ctx = api_context(request)
    results = await asyncio.gather(*(_component_health(ctx, name) for name in COMPONENTS))
    components = dict(zip(COMPONENTS, results))
    try:
        await asyncio.to_thread(ctx.services.jobs.list, limit=1)
        components["Database"] = s.ComponentHealth(status="healthy")
    except Exception as exc:  # noqa: BLE001
        components["Database"] = s.ComponentHealth(status="unhealthy", detail={"error": _unhealthy("Database", exc)})
    healthy = all(c.status != "unhealthy" for c in components.values())
    # Read only: READY is set by the start sequence once every step passed, never by a probe (a probe during
    # STARTING or STOPPING would otherwise let requests in).
    cluster = await asyncio.to_thread(cluster_store(ctx).get)
    nodes = await asyncio.to_thread(_nodes)
    alive = {n["node_id"] for n in nodes if n["alive"]}
    draining = sorted(set(cluster.snapshot.get("draining_nodes", [])) & alive)
    return s.HealthView(
        status="healthy" if healthy else "degraded",
        cluster_state=cluster.state.value,
        config_version=max(cluster.config_version, ctx.config.version),
        profile=ctx.profile,
        gpus=ctx.gpus(),
        nodes=nodes,
        draining_nodes=draining,
        components=components,
    )


def _unhealthy(name: str, exc: Exception) -> str:
    """What /health may say of a failure: an Alloy error's own message; anything else (a driver's text with
    URLs or SQL, a Ray traceback) only in the log."""
    if isinstance(exc, AlloyError):
        return exc.message
    logger.warning("health check of %s failed", name, exc_info=True)
    return "unreachable; the server log has the details"


def cluster_store(ctx: ApiContext) -> ClusterStateStore:
    return ClusterStateStore(ctx.services.db)


def _nodes() -> list[dict[str, Any]]:
    try:
        if not ray.is_initialized():
            return []
        return [
            {
                "node_id": n["NodeID"],
                "alive": bool(n.get("Alive")),
                "address": n.get("NodeManagerAddress"),
                "resources": {k: v for k, v in (n.get("Resources") or {}).items() if k in ("CPU", "GPU", "memory")},
                "head": "node:__internal_head__" in (n.get("Resources") or {}),
            }
            for n in ray.nodes()
        ]
    except Exception:
        logger.warning("could not list ray nodes", exc_info=True)
        return []


@ops_router.get(
    "/metrics",
    dependencies=_scope("read"),
    response_class=Response,
    summary="Prometheus metrics (text exposition format)",
)
async def metrics(request: Request) -> Response:
    ctx = api_context(request)
    counts, throughput = await asyncio.to_thread(_job_figures, ctx.services.jobs)
    ctx.metrics.observe_jobs(counts, throughput)
    cluster = await asyncio.to_thread(cluster_store(ctx).get)
    ctx.metrics.observe_cluster(cluster)
    ctx.metrics.config_version.set(max(cluster.config_version, ctx.config.version))
    for name in CACHED_ENGINES:
        handle = ctx.handles.get(name)
        if handle is None:
            continue
        try:
            ctx.metrics.observe_cache(name, await call(handle, "cache_stats", timeout_s=HEALTH_TIMEOUT_S))
        except Exception:
            logger.debug("cache stats of %s unavailable", name, exc_info=True)
    return Response(ctx.metrics.render(), media_type=CONTENT_TYPE_LATEST)


def _job_figures(jobs: JobStore) -> tuple[dict[tuple[str, str], int], float]:
    counts = {}
    for kind in JobKind:
        for state in JobState:
            counts[(kind.value, state.value)] = jobs.list(state=state, kind=kind, limit=1).total
    running = jobs.list(state=JobState.RUNNING, kind=JobKind.MERGE, limit=500).items
    throughput = sum(float(job.progress.get("bytes_per_s") or 0.0) for job in running)
    return counts, throughput


admin_router = APIRouter(prefix="/admin", tags=["admin"])


@admin_router.post(
    "/reload",
    response_model=s.ReloadView,
    dependencies=_scope("admin"),
    summary="Reload configuration (version increments)",
)
async def reload_config(request: Request) -> s.ReloadView:
    ctx = api_context(request)
    store = cluster_store(ctx)
    await asyncio.to_thread(ctx.config.reload)  # invalid config -> VALIDATION_FAILED, old settings kept
    persisted = (await asyncio.to_thread(store.get)).config_version
    version = max(ctx.config.version, persisted + 1)
    await asyncio.to_thread(store.set_config_version, version)
    return s.ReloadView(config_version=version)


@admin_router.post(
    "/drain",
    response_model=s.DrainView,
    dependencies=_scope("admin"),
    summary="Drain a node: no new tasks are scheduled on it, running ones finish",
)
async def drain_node(body: s.DrainRequest, request: Request) -> s.DrainView:
    ctx = api_context(request)
    node_id, accepted, message = await asyncio.to_thread(drain_ray_node, body.node_id, body.reason, body.deadline_s)
    if not accepted:
        raise AlloyError(ErrorCode.CONFLICT, f"drain of node {node_id} refused: {message}", {"node_id": node_id})
    store = cluster_store(ctx)
    draining = sorted(set((await asyncio.to_thread(store.get)).snapshot.get("draining_nodes", [])) | {node_id})
    await asyncio.to_thread(store.update_snapshot, draining_nodes=draining)
    return s.DrainView(node_id=node_id, accepted=True, message=message or None)


@admin_router.post(
    "/flush",
    response_model=s.FlushView,
    dependencies=_scope("admin"),
    summary="Flush experiment logs (the log sequence number advances)",
)
async def flush_tracker(request: Request) -> s.FlushView:
    return s.FlushView(lsn=await call(api_context(request).handle(c.EXPERIMENT_TRACKER), "flush"))


@admin_router.delete(
    "/cache",
    response_model=s.CacheClearView,
    dependencies=_scope("admin"),
    summary="Clear the engines' model caches (hit rate drops to zero)",
)
async def clear_cache(request: Request) -> s.CacheClearView:
    ctx = api_context(request)
    cleared: dict[str, dict[str, Any]] = {}
    for name in CACHED_ENGINES:
        handle = ctx.handles.get(name)
        if handle is not None:
            cleared[name] = await call(handle, "clear_cache")
            ctx.metrics.observe_cache(name, cleared[name])
    return s.CacheClearView(caches=cleared)
