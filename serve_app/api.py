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

from fastapi import APIRouter, Depends, FastAPI, Request, Response
from fastapi.responses import StreamingResponse

from alloy import components as c
from alloy.errors import AlloyError, ErrorCode, not_found
from alloy.ids import ResourceId
from alloy.jobs.merge_admission import check_merge_inputs, create_merge_job
from alloy.jobs.records import JobKind, JobState
from alloy.storage.keys import ApiKeyStore
from alloy.wire import ArtifactKey, ArtifactPrefix, ExperimentId, JobId
from deployments._calls import call
from serve_app import schemas as s
from serve_app.context import ApiContext, api_context
from serve_app.errors import install_error_handlers
from serve_app.merge_dry_run import DRY_RUN_RESPONSE, dry_run_response
from serve_app.metrics import ApiMetrics, MetricsMiddleware
from serve_app.routes_events import router as events_router
from serve_app.routes_evolutions import router as evolutions_router
from serve_app.routes_keys import router as keys_router
from serve_app.routes_ops import admin_router, ops_router
from serve_app.routing import Limit, Offset
from serve_app.routing import dump as _dump
from serve_app.routing import owner as _owner
from serve_app.routing import page as _page
from serve_app.routing import scope as _scope
from serve_app.security import install_security, is_job_route

logger = logging.getLogger("alloy.api")

# --- jobs ---------------------------------------------------------------------------------------------------
jobs_router = APIRouter(tags=["jobs"])


@jobs_router.get(
    "/jobs/{job_id}",
    response_model=s.JobView,
    dependencies=_scope("read"),
    summary="Progress of a job (the progress_url)",
)
def get_job(job_id: JobId, request: Request) -> s.JobView:
    ctx = api_context(request)
    job = ctx.services.jobs.get(job_id)
    return s.JobView.from_record(job, ctx.url_for_job(request, job.id))


@jobs_router.get("/jobs", response_model=s.PageOf[s.JobView], dependencies=_scope("read"), summary="List jobs")
def list_jobs(
    request: Request,
    state: JobState | None = None,
    kind: JobKind | None = None,
    offset: Offset = 0,
    limit: Limit = 50,
):
    ctx = api_context(request)
    page = ctx.services.jobs.list(state=state, kind=kind, offset=offset, limit=limit)
    return _page(page, lambda job: s.JobView.from_record(job, ctx.url_for_job(request, job.id)))


# --- merge --------------------------------------------------------------------------------------------------
merge_router = APIRouter(tags=["merge"])


@merge_router.get(
    "/methods",
    response_model=list[s.MethodView],
    dependencies=_scope("read"),
    summary="Merge methods: family, parameters, ranges and defaults",
)
async def list_methods() -> list[dict[str, Any]]:
    from alloy.merge.methods import method_catalogue

    return method_catalogue()


@merge_router.post(
    "/merge/execute",
    status_code=202,
    response_model=s.JobAccepted,
    responses=DRY_RUN_RESPONSE,
    dependencies=_scope("write"),
    summary="Start an asynchronous merge job (or, with dry_run, plan it: 200, no job)",
)
async def execute_merge(body: s.MergeRequest, request: Request, response: Response) -> Any:
    ctx = api_context(request)
    ctx.require_gpu_capacity()
    recipe = body.recipe()  # INVALID_STRATEGY / VALIDATION_FAILED before touching anything
    registry = ctx.handle(c.MODEL_REGISTRY)
    manifests, taken = await asyncio.gather(
        call(registry, "manifests", recipe.model_ids),  # MODEL_NOT_FOUND
        call(registry, "exists", body.output_model_id),
    )
    if body.dry_run:
        return await dry_run_response(ctx, body, recipe, manifests, taken)
    # The early, advisory answers (the claim below is the one that counts): 409 for a taken output id, then
    # everything the manifests can tell (shapes, slice ranges).
    check_merge_inputs(body, recipe, output_taken_now=taken, manifests=manifests)
    if body.evaluate is not None:
        datasets = ctx.handle(c.DATASET_REGISTRY)
        await asyncio.gather(*(call(datasets, "get", d) for d in body.evaluate.datasets))
    engine = ctx.handle(c.MERGE_ENGINE)
    # One transaction: the cluster is READY, the output id is claimed (exactly one of concurrent requests for it
    # wins) and not registered; then the job exists.
    job = await asyncio.to_thread(
        create_merge_job, ctx.services.jobs, body, _owner(request), guards=ctx.submission_guards()
    )
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


@evaluations_router.post(
    "/evaluations",
    status_code=202,
    response_model=s.JobAccepted,
    dependencies=_scope("write"),
    summary="Start an evaluation job",
)
async def create_evaluation(body: s.EvaluationRequest, request: Request, response: Response) -> s.JobAccepted:
    ctx = api_context(request)
    ctx.require_gpu_capacity()
    engine = ctx.handle(c.EVALUATION_ENGINE)
    registry, datasets = ctx.handle(c.MODEL_REGISTRY), ctx.handle(c.DATASET_REGISTRY)
    await asyncio.gather(call(registry, "manifests", body.models), *(call(datasets, "get", d) for d in body.datasets))
    job = await ctx.create_job(JobKind.EVALUATION, body.model_dump(mode="json", exclude_none=True), _owner(request))
    engine.run_job.remote(job.id)
    return _accepted(ctx, request, response, job.id)


def _evaluation_job(request: Request, job_id: str):
    job = api_context(request).services.jobs.get(job_id)
    if job.kind is not JobKind.EVALUATION:
        raise not_found("evaluation", job_id)
    return job


@evaluations_router.get("/evaluations/{job_id}", response_model=s.JobView, dependencies=_scope("read"))
def get_evaluation(job_id: JobId, request: Request) -> s.JobView:
    job = _evaluation_job(request, job_id)
    return s.JobView.from_record(job, api_context(request).url_for_job(request, job.id))


@evaluations_router.get(
    "/evaluations/{job_id}/results", response_model=s.EvaluationResults, dependencies=_scope("read")
)
def evaluation_results(job_id: JobId, request: Request) -> s.EvaluationResults:
    job = _evaluation_job(request, job_id)
    if job.state is not JobState.COMPLETED:
        raise AlloyError(
            ErrorCode.CONFLICT,
            f"evaluation {job_id!r} is {job.state.value}, not COMPLETED",
            {"job_id": job_id, "state": job.state.value},
        )
    return s.EvaluationResults(job_id=job.id, **job.result)


# --- models and datasets ------------------------------------------------------------------------------------
models_router = APIRouter(tags=["models"])


@models_router.post("/models", status_code=201, response_model=s.ModelView, dependencies=_scope("write"))
async def register_model(body: s.ModelRegistration, request: Request) -> s.ModelView:
    ctx = api_context(request)
    await asyncio.to_thread(_refuse_claimed, ctx, body.model_id)
    record = await call(
        ctx.handle(c.MODEL_REGISTRY),
        "register",
        body.model_id,
        body.source,
        _owner(request),
        body.lineage,
        body.kind,
        timeout_s=600,
    )
    return s.ModelView.model_validate(_dump(record))


def _refuse_claimed(ctx: ApiContext, model_id: str) -> None:
    """409 for an id an active merge will register (the registry would take it now and fail that merge)."""
    job_id = ctx.services.jobs.claimant(model_id)
    if job_id is not None:
        raise AlloyError(
            ErrorCode.ALREADY_EXISTS,
            f"model {model_id!r} is being produced by job {job_id}",
            {"field": "model_id", "model_id": model_id, "job_id": job_id},
        )


@models_router.get("/models", response_model=s.PageOf[s.ModelView], dependencies=_scope("read"))
async def list_models(request: Request, offset: Offset = 0, limit: Limit = 50):
    page = await call(api_context(request).handle(c.MODEL_REGISTRY), "list", offset, limit)
    return _page(page, lambda r: s.ModelView.model_validate(_dump(r)))


@models_router.get("/models/{model_id:path}", response_model=s.ModelView, dependencies=_scope("read"))
async def get_model(model_id: ResourceId, request: Request) -> s.ModelView:
    record = await call(api_context(request).handle(c.MODEL_REGISTRY), "get", model_id)
    return s.ModelView.model_validate(_dump(record))


@models_router.delete("/models/{model_id:path}", status_code=204, dependencies=_scope("write"))
async def delete_model(model_id: ResourceId, request: Request) -> Response:
    await call(api_context(request).handle(c.MODEL_REGISTRY), "delete", model_id)
    return Response(status_code=204)


datasets_router = APIRouter(tags=["datasets"])


@datasets_router.post("/datasets", status_code=201, response_model=s.DatasetView, dependencies=_scope("write"))
async def register_dataset(body: s.DatasetRegistration, request: Request) -> s.DatasetView:
    record = await call(
        api_context(request).handle(c.DATASET_REGISTRY),
        "register",
        body.dataset_id,
        body.source,
        body.splits,
        body.task,
        _owner(request),
        timeout_s=600,
    )
    return s.DatasetView.model_validate(_dump(record))


@datasets_router.get("/datasets", response_model=s.PageOf[s.DatasetView], dependencies=_scope("read"))
async def list_datasets(request: Request, offset: Offset = 0, limit: Limit = 50):
    page = await call(api_context(request).handle(c.DATASET_REGISTRY), "list", offset, limit)
    return _page(page, lambda r: s.DatasetView.model_validate(_dump(r)))


@datasets_router.get("/datasets/{dataset_id:path}", response_model=s.DatasetView, dependencies=_scope("read"))
async def get_dataset(dataset_id: ResourceId, request: Request) -> s.DatasetView:
    record = await call(api_context(request).handle(c.DATASET_REGISTRY), "get", dataset_id)
    return s.DatasetView.model_validate(_dump(record))


@datasets_router.delete("/datasets/{dataset_id:path}", status_code=204, dependencies=_scope("write"))
async def delete_dataset(dataset_id: ResourceId, request: Request) -> Response:
    await call(api_context(request).handle(c.DATASET_REGISTRY), "delete", dataset_id)
    return Response(status_code=204)


# --- experiments and artifacts ------------------------------------------------------------------------------
experiments_router = APIRouter(tags=["experiments"])


@experiments_router.get("/experiments", response_model=s.PageOf[s.ExperimentView], dependencies=_scope("read"))
async def list_experiments(request: Request, offset: Offset = 0, limit: Limit = 50):
    page = await call(api_context(request).handle(c.EXPERIMENT_TRACKER), "list_experiments", offset, limit)
    return _page(page, lambda r: s.ExperimentView.model_validate(_dump(r)))


@experiments_router.get("/experiments/{experiment_id}", dependencies=_scope("read"))
async def get_experiment(experiment_id: ExperimentId, request: Request) -> dict[str, Any]:
    return _dump(await call(api_context(request).handle(c.EXPERIMENT_TRACKER), "get_experiment", experiment_id))


artifacts_router = APIRouter(tags=["artifacts"])


def _artifact_view(ctx: ApiContext, request: Request, info: Any) -> s.ArtifactView:
    view = s.ArtifactView.model_validate(_dump(info))
    view.download_url = f"{ctx.base_url(request)}/artifacts/{view.key}/content"
    return view


@artifacts_router.get("/artifacts", response_model=list[s.ArtifactView], dependencies=_scope("read"))
async def list_artifacts(request: Request, prefix: ArtifactPrefix = "") -> list[s.ArtifactView]:
    ctx = api_context(request)
    infos = await call(ctx.handle(c.ARTIFACT_STORE), "list", prefix)
    return [_artifact_view(ctx, request, info) for info in infos]


@artifacts_router.get(
    "/artifacts/{key:path}/content",
    dependencies=_scope("read"),
    response_class=StreamingResponse,
    summary="Download an artifact (streamed)",
)
async def download_artifact(key: ArtifactKey, request: Request) -> StreamingResponse:
    from serve_app.ranges import parse_range_start

    ctx = api_context(request)
    store = ctx.handle(c.ARTIFACT_STORE)
    info = await call(store, "info", key)  # NOT_FOUND before any byte is sent
    start = parse_range_start(request.headers.get("range"), info.size)  # a resumed download: "bytes=N-"
    chunks = store.options(stream=True).iter_bytes.remote(key, start)
    name = key.rsplit("/", 1)[-1]
    headers = {
        "Content-Length": str(info.size - start),
        "Accept-Ranges": "bytes",
        "Content-Disposition": f'attachment; filename="{name}"',
    }
    if start:
        headers["Content-Range"] = f"bytes {start}-{info.size - 1}/{info.size}"
    return StreamingResponse(
        chunks, status_code=206 if start else 200, media_type="application/octet-stream", headers=headers
    )


@artifacts_router.get("/artifacts/{key:path}", response_model=s.ArtifactView, dependencies=_scope("read"))
async def artifact_metadata(key: ArtifactKey, request: Request) -> s.ArtifactView:
    ctx = api_context(request)
    return _artifact_view(ctx, request, await call(ctx.handle(c.ARTIFACT_STORE), "info", key))


# --- the cluster-state gate ---------------------------------------------------------------------------------
# Job creation: refused while the cluster drains or stops, when reads (progress polling) still work.


def cluster_gate(request: Request) -> None:
    """Every route but /health and /metrics: 503 SERVICE_UNAVAILABLE (with ``details.cluster_state``) before
    READY, and for job submissions while DRAINING or STOPPING. Without a gate (a plain FastAPI app outside
    Serve, e.g. the uvicorn benchmark) everything passes."""
    gate = api_context(request).cluster_gate
    if gate is None:
        return
    gate.require(submission=is_job_route(request.method, request.url.path))


# --- assembly -----------------------------------------------------------------------------------------------
GATED_ROUTERS = (
    merge_router,
    jobs_router,
    evaluations_router,
    models_router,
    datasets_router,
    experiments_router,
    artifacts_router,
    admin_router,
)
ROUTERS = (ops_router, *GATED_ROUTERS)


def create_api(ctx: ApiContext, *, install_security: bool = True, behind_serve_proxy: bool = False) -> FastAPI:
    """The app; ``behind_serve_proxy``: served by a Serve ingress, whose proxy owns ``X-Request-ID``."""
    from serve_app import console, docs

    app = FastAPI(
        title="Alloy",
        version="1.0",
        docs_url=None,  # served offline by serve_app.docs
        redoc_url=None,
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
    _install_cross_cutting(app, ctx, install_security, behind_serve_proxy)
    return app


def _install_cross_cutting(app: FastAPI, ctx: ApiContext, with_security: bool, behind_serve_proxy: bool) -> None:
    app.add_middleware(MetricsMiddleware, metrics=ctx.metrics)
    install_error_handlers(app, behind_serve_proxy=behind_serve_proxy)
    if with_security:
        install_security(app, key_store_factory=lambda: ApiKeyStore(ctx.services.db), settings=ctx.config.settings)
