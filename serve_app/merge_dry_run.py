"""``POST /merge/execute`` with ``"dry_run": true``: the merge's plan, compatibility verdict and estimated cost,
answered 200 with no job created (:mod:`alloy.merge.dry_run` builds it from the registered manifests)."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

from fastapi.responses import JSONResponse

from alloy.jobs.merge_admission import output_taken
from alloy.jobs.merge_request import MergeRequest
from alloy.merge.dry_run import DryRunReport, dry_run
from alloy.merge.executor import DEFAULT_MAX_IN_FLIGHT_BYTES, DEFAULT_WORKERS
from alloy.merge.recipe import MergeRecipe
from alloy.model_manifest import ModelManifest
from serve_app.context import ApiContext

DRY_RUN_RESPONSE: dict[int | str, dict[str, Any]] = {
    200: {
        "model": DryRunReport,
        "description": 'With "dry_run": true: the plan, the compatibility verdict and the estimates; no job',
    }
}


async def dry_run_response(
    ctx: ApiContext, body: MergeRequest, recipe: MergeRecipe, manifests: Mapping[str, ModelManifest], taken: bool
) -> JSONResponse:
    """The 200 answer. A taken output id is still 409 (the real submission would be refused); incompatible
    models are the report's verdict, not an error."""
    if taken or body.output_model_id in recipe.model_ids:
        raise output_taken(body.output_model_id)
    settings = ctx.config.settings.merge
    report = await asyncio.to_thread(
        dry_run,
        recipe,
        manifests,
        shard_bytes=settings.shard_bytes,
        workers=max(DEFAULT_WORKERS, settings.threads),
        max_in_flight=settings.max_in_flight,
        budget_bytes=DEFAULT_MAX_IN_FLIGHT_BYTES,
        threads=settings.threads,  # the merge engine's torch threads per merge thread
        # WHY 0: the job runs in the merge engine's warm replica, with no interpreter start or imports; the
        # calibrated start of a fresh process (footprint.STARTUP_S) put 2.4 s on a tiny merge that took 0.4 s
        startup_s=0.0,
    )
    return JSONResponse(report.model_dump(mode="json"), status_code=200)
