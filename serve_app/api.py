"""The HTTP API: a FastAPI app built around an :class:`ApiContext`.

:func:`create_api` is used by the Serve ingress (with deployment handles) and can be served by plain uvicorn for
comparison (``bench/http_bench.py``): the job routes read the JobStore directly, everything else goes through the
component deployments' handles.

Scopes: reads need ``read``; job creation and registration need ``write``; ``/admin/*`` needs ``admin``
(enforced by the security middleware and declared on each route).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Query, Request, Response
from fastapi.responses import StreamingResponse

from alloy.cluster_state import ClusterStateStore
from alloy.errors import AlloyError, ErrorCode, not_found
from alloy.jobs import JobKind, JobState
from alloy.merge_jobs import active_merge_outputs, check_merge_inputs
from deployments._calls import call
from serve_app import schemas as s
from serve_app.context import ApiContext, api_context
from serve_app.metrics import CONTENT_TYPE_LATEST, ApiMetrics, MetricsMiddleware
from serve_app.routes_events import router as events_router
from serve_app.routes_keys import router as keys_router
from serve_app.routes_evolutions import router as evolutions_router

logger = logging.getLogger("alloy.api")

COMPONENTS = ("ModelRegistry", "DatasetRegistry", "MergeEngine", "EvaluationEngine", "EvolutionEngine",
              "ExperimentTracker", "ArtifactStore")
HEALTH_TIMEOUT_S = 5.0


def _scope(name: str):
    """``Depends(require_scope(name))`` from the security module; a no-op only while that module is absent."""
    try:
        from serve_app.security import require_scope
    except ImportError:  # pragma: no cover - the security module ships with the app
        return []
    return [Depends(require_scope(name))]


def _owner(request: Request) -> str | None:
    principal = getattr(request.state, "principal", None)
    return getattr(principal, "owner", None)


def _page(page: Any, convert) -> dict[str, Any]:
    return {"items": [convert(item) for item in page.items], "total": page.total, "offset": page.offset,
            "limit": page.limit}


def _dump(record: Any) -> dict[str, Any]:
    return record.model_dump(mode="json") if hasattr(record, "model_dump") else dict(record)


# --- jobs ---------------------------------------------------------------------------------------------------
jobs_router = APIRouter(tags=["jobs"])


@jobs_router.get("/jobs/{job_id}", response_model=s.JobView, dependencies=_scope("read"),
                 summary="Progress of a job (the progress_url)")
def get_job(job_id: str, request: Request) -> s.JobView:
    ctx = api_context(request)
    job = ctx.services.jobs.get(job_id)
    return s.JobView.from_record(job, ctx.url_for_job(request, job.id))


@jobs_router.get("/jobs", response_model=s.PageOf[s.JobView], dependencies=_scope("read"), summary="List jobs")
def list_jobs(request: Request, state: JobState | None = None, kind: JobKind | None = None,
              offset: int = Query(0, ge=0), limit: int = Query(50, ge=1, le=500)):
    ctx = api_context(request)
    page = ctx.services.jobs.list(state=state, kind=kind, offset=offset, limit=limit)
    return _page(page, lambda job: s.JobView.from_record(job, ctx.url_for_job(request, job.id)))


# --- merge --------------------------------------------------------------------------------------------------
merge_router = APIRouter(tags=["merge"])


@merge_router.get("/methods", response_model=list[s.MethodView], dependencies=_scope("read"),
                  summary="Merge methods: family, parameters, ranges and defaults")
async def list_methods() -> list[dict[str, Any]]:
    from alloy.merge.methods import method_catalogue

    return method_catalogue()


@merge_router.post("/merge/execute", status_code=202, response_model=s.JobAccepted, dependencies=_scope("write"),
                   summary="Start an asynchronous merge job")
async def execute_merge(body: s.MergeRequest, request: Request, response: Response) -> s.JobAccepted:
    ctx = api_context(request)
    ctx.require_gpu_capacity()
    recipe = body.recipe()  # INVALID_STRATEGY / VALIDATION_FAILED before touching anything
    registry = ctx.handle("ModelRegistry")
    manifests, taken = await asyncio.gather(
        call(registry, "manifests", recipe.model_ids),  # MODEL_NOT_FOUND
        call(registry, "exists", body.output_model_id),
    )
    in_flight = await asyncio.to_thread(active_merge_outputs, ctx.services.jobs)
    check_merge_inputs(body, recipe, output_taken=taken or body.output_model_id in in_flight, manifests=manifests)
    if body.evaluate is not None:
        datasets = ctx.handle("DatasetRegistry")
        await asyncio.gather(*(call(datasets, "get", d) for d in body.evaluate.datasets))
    engine = ctx.handle("MergeEngine")
    job = await asyncio.to_thread(ctx.services.jobs.create, JobKind.MERGE, body.model_dump(mode="json"),
                                  _owner(request))
    # Fire and forget: the merge becomes an ongoing request of a MergeEngine replica, which owns the job from
    # here on; this ingress replica may go away without affecting it.
    engine.run_job.remote(job.id)
    return _accepted(ctx, request, response, job.id)


def _accepted(ctx: ApiContext, request: Request, response: Response, job_id: str) -> s.JobAccepted:
    url = ctx.url_for_job(request, job_id)
    response.headers["Location"] = url
    return s.JobAccepted(job_id=job_id, progress_url=url)


# --- evaluations --------------------------------------------------------------------------------------------
evaluations_router = APIRouter(tags=["evaluations"])


@evaluations_router.post("/evaluations", status_code=202, response_model=s.JobAccepted,
                         dependencies=_scope("write"), summary="Start an evaluation job")
async def create_evaluation(body: s.EvaluationRequest, request: Request, response: Response) -> s.JobAccepted:
    ctx = api_context(request)
    ctx.require_gpu_capacity()
    engine = ctx.handle("EvaluationEngine")
    registry, datasets = ctx.handle("ModelRegistry"), ctx.handle("DatasetRegistry")
    await asyncio.gather(call(registry, "manifests", body.models),
                         *(call(datasets, "get", d) for d in body.datasets))
    job = await asyncio.to_thread(ctx.services.jobs.create, JobKind.EVALUATION, body.model_dump(mode="json"),
                                  _owner(request))
    engine.run_job.remote(job.id)
    return _accepted(ctx, request, response, job.id)


def _evaluation_job(request: Request, job_id: str):
    job = api_context(request).services.jobs.get(job_id)
    if job.kind is not JobKind.EVALUATION:
        raise not_found("evaluation", job_id)
    return job


@evaluations_router.get("/evaluations/{job_id}", response_model=s.JobView, dependencies=_scope("read"))
def get_evaluation(job_id: str, request: Request) -> s.JobView:
    job = _evaluation_job(request, job_id)
    return s.JobView.from_record(job, api_context(request).url_for_job(request, job.id))


@evaluations_router.get("/evaluations/{job_id}/results", response_model=s.EvaluationResults,
                        dependencies=_scope("read"))
def evaluation_results(job_id: str, request: Request) -> s.EvaluationResults:
    job = _evaluation_job(request, job_id)
    if job.state is not JobState.COMPLETED:
        raise AlloyError(ErrorCode.CONFLICT, f"evaluation {job_id!r} is {job.state.value}, not COMPLETED",
                         {"job_id": job_id, "state": job.state.value})
    return s.EvaluationResults(job_id=job.id, **job.result)


# --- models and datasets ------------------------------------------------------------------------------------
models_router = APIRouter(tags=["models"])


@models_router.post("/models", status_code=201, response_model=s.ModelView, dependencies=_scope("write"))
async def register_model(body: s.ModelRegistration, request: Request) -> s.ModelView:
    record = await call(api_context(request).handle("ModelRegistry"), "register", body.model_id, body.source,
                        _owner(request), body.lineage, timeout_s=600)
    return s.ModelView.model_validate(_dump(record))


@models_router.get("/models", response_model=s.PageOf[s.ModelView], dependencies=_scope("read"))
async def list_models(request: Request, offset: int = Query(0, ge=0), limit: int = Query(50, ge=1, le=500)):
    page = await call(api_context(request).handle("ModelRegistry"), "list", offset, limit)
    return _page(page, lambda r: s.ModelView.model_validate(_dump(r)))


@models_router.get("/models/{model_id:path}", response_model=s.ModelView, dependencies=_scope("read"))
async def get_model(model_id: str, request: Request) -> s.ModelView:
    record = await call(api_context(request).handle("ModelRegistry"), "get", model_id)
    return s.ModelView.model_validate(_dump(record))


@models_router.delete("/models/{model_id:path}", status_code=204, dependencies=_scope("write"))
async def delete_model(model_id: str, request: Request) -> Response:
    await call(api_context(request).handle("ModelRegistry"), "delete", model_id)
    return Response(status_code=204)


datasets_router = APIRouter(tags=["datasets"])


@datasets_router.post("/datasets", status_code=201, response_model=s.DatasetView, dependencies=_scope("write"))
async def register_dataset(body: s.DatasetRegistration, request: Request) -> s.DatasetView:
    record = await call(api_context(request).handle("DatasetRegistry"), "register", body.dataset_id, body.source,
                        body.splits, body.task, _owner(request), timeout_s=600)
    return s.DatasetView.model_validate(_dump(record))


@datasets_router.get("/datasets", response_model=s.PageOf[s.DatasetView], dependencies=_scope("read"))
async def list_datasets(request: Request, offset: int = Query(0, ge=0), limit: int = Query(50, ge=1, le=500)):
    page = await call(api_context(request).handle("DatasetRegistry"), "list", offset, limit)
    return _page(page, lambda r: s.DatasetView.model_validate(_dump(r)))


@datasets_router.get("/datasets/{dataset_id:path}", response_model=s.DatasetView, dependencies=_scope("read"))
async def get_dataset(dataset_id: str, request: Request) -> s.DatasetView:
    record = await call(api_context(request).handle("DatasetRegistry"), "get", dataset_id)
    return s.DatasetView.model_validate(_dump(record))


@datasets_router.delete("/datasets/{dataset_id:path}", status_code=204, dependencies=_scope("write"))
async def delete_dataset(dataset_id: str, request: Request) -> Response:
    await call(api_context(request).handle("DatasetRegistry"), "delete", dataset_id)
    return Response(status_code=204)


# --- experiments and artifacts ------------------------------------------------------------------------------
experiments_router = APIRouter(tags=["experiments"])


@experiments_router.get("/experiments", response_model=s.PageOf[s.ExperimentView], dependencies=_scope("read"))
async def list_experiments(request: Request, offset: int = Query(0, ge=0), limit: int = Query(50, ge=1, le=500)):
    page = await call(api_context(request).handle("ExperimentTracker"), "list_experiments", offset, limit)
    return _page(page, lambda r: s.ExperimentView.model_validate(_dump(r)))


@experiments_router.get("/experiments/{experiment_id}", dependencies=_scope("read"))
async def get_experiment(experiment_id: str, request: Request) -> dict[str, Any]:
    return _dump(await call(api_context(request).handle("ExperimentTracker"), "get_experiment", experiment_id))


artifacts_router = APIRouter(tags=["artifacts"])


def _artifact_view(ctx: ApiContext, request: Request, info: Any) -> s.ArtifactView:
    view = s.ArtifactView.model_validate(_dump(info))
    view.download_url = f"{ctx.base_url(request)}/artifacts/{view.key}/content"
    return view


@artifacts_router.get("/artifacts", response_model=list[s.ArtifactView], dependencies=_scope("read"))
async def list_artifacts(request: Request, prefix: str = "") -> list[s.ArtifactView]:
    ctx = api_context(request)
    infos = await call(ctx.handle("ArtifactStore"), "list", prefix)
    return [_artifact_view(ctx, request, info) for info in infos]


@artifacts_router.get("/artifacts/{key:path}/content", dependencies=_scope("read"),
                      response_class=StreamingResponse, summary="Download an artifact (streamed)")
async def download_artifact(key: str, request: Request) -> StreamingResponse:
    from serve_app.ranges import parse_range_start

    ctx = api_context(request)
    store = ctx.handle("ArtifactStore")
    info = await call(store, "info", key)  # NOT_FOUND before any byte is sent
    start = parse_range_start(request.headers.get("range"), info.size)  # a resumed download: "bytes=N-"
    chunks = store.options(stream=True).iter_bytes.remote(key, start)
    name = key.rsplit("/", 1)[-1]
    headers = {"Content-Length": str(info.size - start), "Accept-Ranges": "bytes",
               "Content-Disposition": f'attachment; filename="{name}"'}
    if start:
        headers["Content-Range"] = f"bytes {start}-{info.size - 1}/{info.size}"
    return StreamingResponse(chunks, status_code=206 if start else 200, media_type="application/octet-stream",
                             headers=headers)


@artifacts_router.get("/artifacts/{key:path}", response_model=s.ArtifactView, dependencies=_scope("read"))
async def artifact_metadata(key: str, request: Request) -> s.ArtifactView:
    ctx = api_context(request)
    return _artifact_view(ctx, request, await call(ctx.handle("ArtifactStore"), "info", key))


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
        return s.ComponentHealth(status="unhealthy", detail={"error": f"{type(exc).__name__}: {exc}"[:500]})


@ops_router.get("/health", response_model=s.HealthView, dependencies=_scope("read"),
                summary="Cluster state and the health of every component")
async def health(request: Request) -> s.HealthView:
    ctx = api_context(request)
    results = await asyncio.gather(*(_component_health(ctx, name) for name in COMPONENTS))
    components = dict(zip(COMPONENTS, results))
    try:
        await asyncio.to_thread(ctx.services.jobs.list, limit=1)
        components["Database"] = s.ComponentHealth(status="healthy")
    except Exception as exc:  # noqa: BLE001
        components["Database"] = s.ComponentHealth(status="unhealthy", detail={"error": str(exc)[:500]})
    healthy = all(c.status != "unhealthy" for c in components.values())
    # Read only: READY is set by the start sequence once every step passed, never by a probe (a probe during
    # STARTING or STOPPING would otherwise let requests in).
    cluster = await asyncio.to_thread(_cluster_store(ctx).get)
    nodes = await asyncio.to_thread(_nodes)
    alive = {n["node_id"] for n in nodes if n["alive"]}
    draining = sorted(set(cluster.snapshot.get("draining_nodes", [])) & alive)
    return s.HealthView(
        status="healthy" if healthy else "degraded", cluster_state=cluster.state.value,
        config_version=max(cluster.config_version, ctx.config.version), profile=ctx.profile, gpus=ctx.gpus(),
        nodes=nodes, draining_nodes=draining, components=components,
    )


def _cluster_store(ctx: ApiContext) -> ClusterStateStore:
    return ClusterStateStore(ctx.services.db)


def _nodes() -> list[dict[str, Any]]:
    try:
        import ray

        if not ray.is_initialized():
            return []
        return [
            {"node_id": n["NodeID"], "alive": bool(n.get("Alive")), "address": n.get("NodeManagerAddress"),
             "resources": {k: v for k, v in (n.get("Resources") or {}).items() if k in ("CPU", "GPU", "memory")},
             "head": "node:__internal_head__" in (n.get("Resources") or {})}
            for n in ray.nodes()
        ]
    except Exception:  # noqa: BLE001 - health must answer even if the GCS is briefly unreachable
        logger.warning("could not list ray nodes", exc_info=True)
        return []


@ops_router.get("/metrics", dependencies=_scope("read"), response_class=Response,
                summary="Prometheus metrics (text exposition format)")
async def metrics(request: Request) -> Response:
    ctx = api_context(request)
    counts, throughput = await asyncio.to_thread(_job_figures, ctx.services.jobs)
    ctx.metrics.observe_jobs(counts, throughput)
    cluster = await asyncio.to_thread(_cluster_store(ctx).get)
    ctx.metrics.observe_cluster(cluster)
    ctx.metrics.config_version.set(max(cluster.config_version, ctx.config.version))
    for name in ("MergeEngine", "EvaluationEngine"):
        handle = ctx.handles.get(name)
        if handle is None:
            continue
        try:
            ctx.metrics.observe_cache(name, await call(handle, "cache_stats", timeout_s=HEALTH_TIMEOUT_S))
        except Exception:  # noqa: BLE001 - a busy or absent engine leaves its last figures
            logger.debug("cache stats of %s unavailable", name, exc_info=True)
    return Response(ctx.metrics.render(), media_type=CONTENT_TYPE_LATEST)


def _job_figures(jobs) -> tuple[dict[tuple[str, str], int], float]:
    counts = {}
    for kind in JobKind:
        for state in JobState:
            counts[(kind.value, state.value)] = jobs.list(state=state, kind=kind, limit=1).total
    running = jobs.list(state=JobState.RUNNING, kind=JobKind.MERGE, limit=500).items
    throughput = sum(float(job.progress.get("bytes_per_s") or 0.0) for job in running)
    return counts, throughput


admin_router = APIRouter(prefix="/admin", tags=["admin"])


@admin_router.post("/reload", response_model=s.ReloadView, dependencies=_scope("admin"),
                   summary="Reload configuration (version increments)")
async def reload_config(request: Request) -> s.ReloadView:
    ctx = api_context(request)
    store = _cluster_store(ctx)
    await asyncio.to_thread(ctx.config.reload)  # invalid config -> VALIDATION_FAILED, old settings kept
    persisted = (await asyncio.to_thread(store.get)).config_version
    version = max(ctx.config.version, persisted + 1)
    await asyncio.to_thread(store.set_config_version, version)
    return s.ReloadView(config_version=version)


@admin_router.post("/drain", response_model=s.DrainView, dependencies=_scope("admin"),
                   summary="Drain a node: no new tasks are scheduled on it, running ones finish")
async def drain_node(body: s.DrainRequest, request: Request) -> s.DrainView:
    from alloy.lifecycle import drain_ray_node

    ctx = api_context(request)
    node_id, accepted, message = await asyncio.to_thread(drain_ray_node, body.node_id, body.reason, body.deadline_s)
    if not accepted:
        raise AlloyError(ErrorCode.CONFLICT, f"drain of node {node_id} refused: {message}", {"node_id": node_id})
    store = _cluster_store(ctx)
    draining = sorted(set((await asyncio.to_thread(store.get)).snapshot.get("draining_nodes", [])) | {node_id})
    await asyncio.to_thread(store.update_snapshot, draining_nodes=draining)
    return s.DrainView(node_id=node_id, accepted=True, message=message or None)


@admin_router.post("/flush", response_model=s.FlushView, dependencies=_scope("admin"),
                   summary="Flush experiment logs (the log sequence number advances)")
async def flush_tracker(request: Request) -> s.FlushView:
    return s.FlushView(lsn=await call(api_context(request).handle("ExperimentTracker"), "flush"))


@admin_router.delete("/cache", response_model=s.CacheClearView, dependencies=_scope("admin"),
                     summary="Clear the engines' model caches (hit rate drops to zero)")
async def clear_cache(request: Request) -> s.CacheClearView:
    ctx = api_context(request)
    cleared: dict[str, dict[str, Any]] = {}
    for name in ("MergeEngine", "EvaluationEngine"):
        handle = ctx.handles.get(name)
        if handle is not None:
            cleared[name] = await call(handle, "clear_cache")
            ctx.metrics.observe_cache(name, cleared[name])
    return s.CacheClearView(caches=cleared)


# --- the cluster-state gate ---------------------------------------------------------------------------------
# Job creation: refused while the cluster drains or stops, when reads (progress polling) still work.
SUBMISSION_PATHS = frozenset({"/merge/execute", "/evaluations", "/evolutions"})


def cluster_gate(request: Request) -> None:
    """Every route but /health and /metrics: 503 SERVICE_UNAVAILABLE (with ``details.cluster_state``) before
    READY, and for job submissions while DRAINING or STOPPING. Without a gate (a plain FastAPI app outside
    Serve, e.g. the uvicorn benchmark) everything passes."""
    gate = api_context(request).cluster_gate
    if gate is None:
        return
    submission = request.method == "POST" and request.url.path.rstrip("/") in SUBMISSION_PATHS
    gate.require(submission=submission)


# --- assembly -----------------------------------------------------------------------------------------------
GATED_ROUTERS = (merge_router, jobs_router, evaluations_router, models_router, datasets_router,
                 experiments_router, artifacts_router, admin_router)
ROUTERS = (ops_router, *GATED_ROUTERS)


def create_api(ctx: ApiContext, *, install_security: bool = True) -> FastAPI:
    from serve_app import console, docs

    app = FastAPI(
        title="Alloy", version="1.0", docs_url=None, redoc_url=None,  # served offline by serve_app.docs
        description="Model merge and evolution service. Every request carries an API key "
                    "(`Authorization: Bearer <key>` or `X-API-Key`).",
    )
    app.state.ctx = ctx
    app.state.public_paths = (*docs.PUBLIC_PATHS, *console.PUBLIC_PATHS)
    docs.install_offline_docs(app)
    console.install_console(app)  # the web console at /ui
    ctx.metrics = ctx.metrics or ApiMetrics()
    app.include_router(ops_router)  # /health and /metrics answer in every cluster state
    gated = [Depends(cluster_gate)]
    for router in GATED_ROUTERS:
        app.include_router(router, dependencies=gated)
    app.include_router(evolutions_router, dependencies=gated)
    app.include_router(events_router, dependencies=gated)  # GET /jobs/{id}/events: history or live SSE
    app.include_router(keys_router, dependencies=gated)  # /admin/keys
    _install_cross_cutting(app, ctx, install_security)
    return app


def _install_cross_cutting(app: FastAPI, ctx: ApiContext, with_security: bool) -> None:
    from serve_app.errors import install_error_handlers

    app.add_middleware(MetricsMiddleware, metrics=ctx.metrics)
    install_error_handlers(app)
    if with_security:
        from alloy.keys import ApiKeyStore
        from serve_app.security import install_security

        install_security(app, key_store_factory=lambda: ApiKeyStore(ctx.services.db), settings=ctx.config.settings)
