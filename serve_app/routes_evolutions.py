"""HTTP routes of evolutions: start (rate-limited as a job), progress, candidates, cancel, promote a Pareto front
member.

The ingress validates the request, creates the job (CREATED) and hands it to the EvolutionEngine deployment
without awaiting it; the engine writes state and progress to the JobStore, which these GETs read.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Query, Request, Response

from alloy import components as c
from alloy.errors import not_found
from alloy.jobs.records import JobKind, JobRecord
from alloy.storage.tracker import ExperimentTracker
from alloy.wire import JobId
from alloy.wire_evolution import EvolutionView, PromoteRequest, PromotionView
from deployments._calls import call
from evolution.config import EvolutionSpec
from evolution.engine import EvolutionService
from evolution.inputs import check_before_job
from serve_app.context import api_context
from serve_app.routing import owner as _owner
from serve_app.routing import scope
from serve_app.schemas import JobAccepted

router = APIRouter(tags=["evolutions"])
MAX_GENERATION = 2**31 - 1
PROMOTE_TIMEOUT_S = 1800  # a bound for the query (a larger integer would overflow the database's)


def _evolution(request: Request, job_id: str) -> JobRecord:
    job = api_context(request).services.jobs.get(job_id)
    if job.kind is not JobKind.EVOLUTION:
        raise not_found("evolution", job_id)
    return job


def _progress_url(request: Request, job_id: str) -> str:
    return f"{api_context(request).base_url(request)}/evolutions/{job_id}"


def _view(request: Request, job: JobRecord) -> dict[str, Any]:
    progress = job.progress or {}
    return {
        "job_id": job.id,
        "state": job.state.value,
        "progress_url": _progress_url(request, job.id),
        "generation": progress.get("generation", 0),
        "generations": progress.get("generations", job.request.get("search", {}).get("generations")),
        "population": progress.get("population", job.request.get("search", {}).get("population")),
        "best_fitness": progress.get("best_fitness"),
        "median_fitness": progress.get("median_fitness"),
        "trials": progress.get("trials", 0),
        "percent": progress.get("percent", 0.0),
        "cancel_requested": bool(progress.get("cancel_requested", False)),
        "attempts": job.attempts,  # > 0: the evolution was interrupted and replayed (it resumes its Tune run)
        "resumed_from_checkpoint": bool(progress.get("resumed_from_checkpoint", False)),
        "trials_url": f"{_progress_url(request, job.id)}/trials",
        "result": job.result,
        "pareto_front": (job.result or {}).get("pareto_front"),
        "error": job.error.model_dump() if job.error else None,
        "created_at": job.created_at,
        "updated_at": job.updated_at,
    }


@router.post(
    "/evolutions",
    status_code=202,
    response_model=JobAccepted,
    dependencies=scope("write"),
    summary="Start an evolution job",
)
async def create_evolution(body: EvolutionSpec, request: Request, response: Response) -> JobAccepted:
    ctx = api_context(request)
    ctx.require_gpu_capacity()
    engine = ctx.handle(c.EVOLUTION_ENGINE)
    check_before_job(body)
    if body.preset is None:  # registered parents and datasets must exist (a preset's are built by the run)
        registry, datasets = ctx.handle(c.MODEL_REGISTRY), ctx.handle(c.DATASET_REGISTRY)
        parents = [*(body.models or []), *([body.base_model] if body.base_model else [])]
        await asyncio.gather(
            *(call(registry, "get", m) for m in parents), *(call(datasets, "get", d) for d in body.datasets or [])
        )
    job = await ctx.create_job(JobKind.EVOLUTION, body.model_dump(mode="json"), _owner(request))
    engine.run_job.remote(job.id)  # fire and forget: the engine replica owns the job from here on
    url = _progress_url(request, job.id)
    response.headers["Location"] = url
    return JobAccepted(job_id=job.id, progress_url=url)


@router.get(
    "/evolutions/{job_id}",
    response_model=EvolutionView,
    dependencies=scope("read"),
    summary="Progress of an evolution: generation, best and median fitness, trials; its Pareto front (nsga2)",
)
def get_evolution(job_id: JobId, request: Request) -> dict[str, Any]:
    return _view(request, _evolution(request, job_id))


@router.get(
    "/evolutions/{job_id}/trials",
    dependencies=scope("read"),
    summary="Every evaluated candidate: genome, recipe, metrics, parent trial",
)
def evolution_trials(
    job_id: JobId, request: Request, generation: int | None = Query(None, ge=0, le=MAX_GENERATION)
) -> dict[str, Any]:
    job = _evolution(request, job_id)
    services = api_context(request).services
    reader = EvolutionService(
        services.settings, db=services.db, jobs=services.jobs, tracker=ExperimentTracker(services.db), models=None
    )
    trials = reader.trials(job.id, generation)
    return {"job_id": job.id, "state": job.state.value, "count": len(trials), "trials": trials}


@router.post(
    "/evolutions/{job_id}/cancel",
    status_code=202,
    dependencies=scope("write"),
    summary="Stop a running evolution (it ends FAILED with code CANCELLED)",
)
async def cancel_evolution(job_id: JobId, request: Request) -> dict[str, Any]:
    _evolution(request, job_id)
    services = api_context(request).services
    # The request is recorded in the JobStore; the process running the search (a Serve replica or a
    # `ray job submit` driver) sees it within seconds and stops Tune.
    canceller = EvolutionService(
        services.settings, db=services.db, jobs=services.jobs, tracker=ExperimentTracker(services.db), models=None
    )
    job = await asyncio.to_thread(canceller.cancel, job_id)
    return _view(request, job)


@router.post(
    "/evolutions/{job_id}/promote",
    status_code=201,
    response_model=PromotionView,
    dependencies=scope("write"),
    summary="Register a Pareto front member of a completed evolution as a model (merged, registered, tested once)",
)
async def promote_member(job_id: JobId, body: PromoteRequest, request: Request) -> PromotionView:
    _evolution(request, job_id)
    ctx = api_context(request)
    # The engine replica merges and registers (the ingress holds no parents); a merge of a large model takes
    # minutes, hence the long timeout.
    view = await call(
        ctx.handle(c.EVOLUTION_ENGINE), "promote", job_id, body.candidate_id, body.model_id, timeout_s=PROMOTE_TIMEOUT_S
    )
    return PromotionView.model_validate(view)
