"""A merge job's request (the body of POST /merge/execute) and its synchronous validation.

The HTTP ingress calls :func:`validate_merge_request` (or :func:`check_merge_inputs` with what the registry
deployment answered) before it creates a job, so a client learns about a bad strategy, a missing model or
incompatible shapes at once; the runner (:mod:`alloy.jobs.merge_runner`) validates again when it runs.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from alloy.errors import AlloyError, ErrorCode
from alloy.ids import ResourceId
from alloy.jobs.store import JobKind, JobStore
from alloy.merge.executor import check_compatibility
from alloy.merge.recipe import MergeRecipe, validate_recipe
from alloy.model_manifest import ModelManifest
from alloy.registry.models import ModelRegistry
from kernels.registry import METHODS

# The merge methods (mergekit names), each a variant of one strategy family: an enum in the OpenAPI schema.
# (A Literal built at run time: mypy sees a plain str.)
if TYPE_CHECKING:
    MethodName = str
else:
    MethodName = Literal[tuple(sorted(METHODS))]


class EvaluateSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    datasets: list[str] = Field(min_length=1, max_length=16, description="Registered dataset ids")
    split: str = Field("test", description="Dataset split to evaluate on")


class MergeRequest(BaseModel):
    """Body of POST /merge/execute."""

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "examples": [
                {
                    "models": ["tiny-a", "tiny-b"],
                    "strategy": "ties",
                    "parameters": {"density": 0.5},
                    "output_model_id": "my-merge",
                }
            ]
        },
    )

    models: list[str] = Field(min_length=2, max_length=8, description="Model ids to merge (2-8)")
    strategy: str = Field(
        description="slerp | ties | dare | task_arithmetic | franken_merge (anything else: 422 INVALID_STRATEGY)"
    )
    variant: MethodName | None = Field(
        None,
        description="A merge method of the strategy's family, by its mergekit name (GET /methods lists them). "
        "Default: the family's own method; ties with epsilon > 0 is della (DELLA's MagPrune), "
        "dare with consensus: true is dare_ties, otherwise dare_linear",
    )
    parameters: dict[str, Any] = Field(default_factory=dict, description="Strategy parameters (global)")
    output_model_id: ResourceId = Field(description="ID of the merged model; must be new")
    base_model: str | None = Field(None, description="Base model for task vectors (ties, dare, task_arithmetic)")
    model_parameters: dict[str, dict[str, Any]] | None = Field(None, description="Per-model parameters")
    slices: list[dict[str, Any]] | None = Field(
        None,
        description="Output slices: franken_merge shorthand [{model, layer_range}], or mergekit's "
        "[{sources: [{model, layer_range, parameters}], parameters, base_model}] for any strategy",
    )
    dtype: str | None = Field(None, description="float32 | float16 | bfloat16")
    seed: int | None = Field(None, description="Seed for stochastic strategies (dare)")
    evaluate: EvaluateSpec | None = Field(None, description="Evaluate the merged model before COMPLETED")
    parallelism: int | None = Field(
        None,
        ge=1,
        le=64,
        description="Fan the merge out: up to this many groups of output shards, each a Ray task on any node, "
        "writing its shards straight to the artifact store (1: one process). Default: the server decides by "
        "the output size (merge.fanout_threshold_bytes). Bit-identical either way; not with evaluate",
    )

    @model_validator(mode="after")
    def _fanout_without_evaluate(self) -> MergeRequest:
        if self.parallelism and self.parallelism > 1 and self.evaluate is not None:
            raise ValueError("parallelism > 1 cannot be combined with evaluate (the output is never on one node)")
        return self

    def recipe(self) -> MergeRecipe:
        fields = self.model_dump(exclude={"output_model_id", "evaluate", "parallelism"})
        return validate_recipe(MergeRecipe.from_request_fields(**fields))


# --- synchronous validation ---------------------------------------------------------------------------------


def check_merge_inputs(
    request: MergeRequest, recipe: MergeRecipe, *, output_taken: bool, manifests: Mapping[str, ModelManifest]
) -> None:
    """The checks that need the registry, given what it answered: ALREADY_EXISTS (output id registered or being
    produced by another job), INCOMPATIBLE_MODELS. (MODEL_NOT_FOUND comes from fetching ``manifests``.)"""
    if request.output_model_id in recipe.model_ids:
        raise AlloyError(
            ErrorCode.VALIDATION_FAILED,
            "output_model_id must differ from the input models",
            {"field": "output_model_id"},
        )
    if output_taken:
        raise AlloyError(
            ErrorCode.ALREADY_EXISTS,
            f"model {request.output_model_id!r} already exists",
            {"field": "output_model_id", "model_id": request.output_model_id},
        )
    check_compatibility(recipe, manifests)


def validate_merge_request(
    request: MergeRequest, *, models: ModelRegistry, jobs: JobStore | None = None
) -> MergeRecipe:
    """Everything that can be checked before a job exists, against a plain ModelRegistry: INVALID_STRATEGY,
    VALIDATION_FAILED, ALREADY_EXISTS, MODEL_NOT_FOUND, INCOMPATIBLE_MODELS. Returns the validated recipe."""
    recipe = request.recipe()
    taken = models.exists(request.output_model_id) or (
        jobs is not None and request.output_model_id in active_merge_outputs(jobs)
    )
    manifests = {model_id: models.manifest(model_id) for model_id in recipe.model_ids}
    check_merge_inputs(request, recipe, output_taken=taken, manifests=manifests)
    return recipe


def active_merge_outputs(jobs: JobStore) -> set[str]:
    """Output ids that running or queued merge jobs will register."""
    return {str(job.request.get("output_model_id")) for job in jobs.active(kind=JobKind.MERGE)}
