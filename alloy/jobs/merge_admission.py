"""A merge job's admission: the synchronous checks of a :class:`~alloy.jobs.merge_request.MergeRequest` that need
the registry, and the job's creation with its claim on the output id.

The HTTP ingress calls :func:`validate_merge_request` (or :func:`check_merge_inputs` with what the registry
deployment answered) before it creates a job, so a client learns about a bad strategy, a missing model,
incompatible shapes or a slice past a model's layers at once; :func:`create_merge_job` then writes the job with
its claim on the output id (atomic: of concurrent requests for one output id exactly one is accepted). The
runner (:mod:`alloy.jobs.merge_runner`) validates again when it runs. Apart from the request model because these
need the database (SQLAlchemy), which the wire models and the client do not.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from sqlalchemy import or_, select
from sqlalchemy.orm import Session

from alloy.errors import AlloyError, ErrorCode, validation_failed
from alloy.jobs.merge_request import MergeRequest
from alloy.jobs.records import JobKind, JobRecord
from alloy.jobs.store import Guard, JobStore
from alloy.merge.executor import check_compatibility
from alloy.merge.plan import build_plan, layout_from_manifest
from alloy.merge.recipe import MergeRecipe
from alloy.model_manifest import ModelManifest
from alloy.registry.adapters import input_manifest
from alloy.registry.ids import namespace_clashes
from alloy.registry.models import ModelRegistry
from alloy.storage.db.models import ModelRow

# --- synchronous validation ---------------------------------------------------------------------------------


def output_taken(model_id: str) -> AlloyError:
    return AlloyError(
        ErrorCode.ALREADY_EXISTS,
        f"model {model_id!r} already exists",
        {"field": "output_model_id", "model_id": model_id},
    )


def check_merge_inputs(
    request: MergeRequest, recipe: MergeRecipe, *, output_taken_now: bool, manifests: Mapping[str, ModelManifest]
) -> None:
    """The checks that need the registry, given what it answered: ALREADY_EXISTS (the output id is registered,
    an input among them, or claimed by another job), INCOMPATIBLE_MODELS, and the plan itself (a slice's layer
    range past its model's layers: VALIDATION_FAILED), so that nothing checkable from the manifests is left for
    the job to fail on. (MODEL_NOT_FOUND comes from fetching ``manifests``.)"""
    if output_taken_now or request.output_model_id in recipe.model_ids:
        raise output_taken(request.output_model_id)
    check_compatibility(recipe, manifests)
    build_plan(recipe, {model_id: layout_from_manifest(manifests[model_id]) for model_id in recipe.model_ids})


def validate_merge_request(
    request: MergeRequest, *, models: ModelRegistry, jobs: JobStore | None = None
) -> MergeRecipe:
    """Everything that can be checked before a job exists, against a plain ModelRegistry: INVALID_STRATEGY,
    VALIDATION_FAILED, ALREADY_EXISTS, MODEL_NOT_FOUND, INCOMPATIBLE_MODELS. Returns the validated recipe.
    (Advisory: the claim itself is taken by :func:`create_merge_job`.)"""
    recipe = request.recipe()
    taken = models.exists(request.output_model_id) or (
        jobs is not None and jobs.claimant(request.output_model_id) is not None
    )
    manifests = {model_id: input_manifest(models.manifest, model_id) for model_id in recipe.model_ids}
    check_merge_inputs(request, recipe, output_taken_now=taken, manifests=manifests)
    return recipe


# --- the job, with its output claim ---------------------------------------------------------------------------


def create_merge_job(
    jobs: JobStore, request: MergeRequest, owner: str | None = None, *, guards: Sequence[Guard] = ()
) -> JobRecord:
    """The one way a merge job is written. In one transaction: the job with its claim on the output id (the
    database's unique index over active jobs: a second active claim is ALREADY_EXISTS), then ``guards`` (e.g.
    the cluster-state gate) and the check that no registered model holds or nests with the id. The registry
    check runs after the claim is written: a job that completes meanwhile has registered its model before it
    left the active states, so one of the two checks sees it."""
    return jobs.create(
        JobKind.MERGE,
        request.model_dump(mode="json"),
        owner,
        output_model_id=request.output_model_id,
        guards=[*guards, _output_unregistered(request.output_model_id)],
    )


def _output_unregistered(model_id: str) -> Guard:
    clashes = namespace_clashes(model_id)  # the registry's rule: "org" and "org/name" cannot both exist

    def guard(session: Session) -> None:
        holder = session.scalar(
            select(ModelRow.id)
            .where(
                or_(
                    ModelRow.id == model_id,
                    ModelRow.id.in_(clashes),
                    ModelRow.id.startswith(model_id + "/", autoescape=True),
                )
            )
            .order_by(ModelRow.id != model_id)
            .limit(1)
        )
        if holder == model_id:
            raise output_taken(model_id)
        if holder is not None:
            raise validation_failed(
                f"model id {model_id!r} clashes with the namespace of {holder!r}",
                field="output_model_id",
                clashes_with=holder,
            )

    return guard
