"""A merge job's request (the body of POST /merge/execute), its synchronous validation and its creation.

The HTTP ingress calls :func:`validate_merge_request` (or :func:`check_merge_inputs` with what the registry
deployment answered) before it creates a job, so a client learns about a bad strategy, a missing model,
incompatible shapes or a slice past a model's layers at once; :func:`create_merge_job` then writes the job with
its claim on the output id (atomic: of concurrent requests for one output id exactly one is accepted). The
runner (:mod:`alloy.jobs.merge_runner`) validates again when it runs.

Every field is bounded (lengths, list sizes, numbers, no control characters), and the OpenAPI document says so.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator
from sqlalchemy import or_, select
from sqlalchemy.orm import Session

from alloy.errors import AlloyError, ErrorCode, validation_failed
from alloy.ids import ModelReference, ResourceId, ShortText
from alloy.jobs.store import Guard, JobKind, JobRecord, JobStore
from alloy.merge.executor import check_compatibility
from alloy.merge.methods import FAMILIES
from alloy.merge.plan import build_plan, layout_from_manifest
from alloy.merge.recipe import MAX_MODELS, MIN_MODELS, MergeRecipe, OutputDtype, validate_recipe
from alloy.model_manifest import ModelManifest
from alloy.registry.adapters import input_manifest
from alloy.registry.datasets import SPLIT_PATTERN
from alloy.registry.ids import namespace_clashes
from alloy.registry.models import ModelRegistry
from alloy.storage.db.models import ModelRow
from kernels.registry import METHODS

# The merge methods (mergekit names), each a variant of one strategy family: an enum in the OpenAPI schema.
# (A Literal built at run time: mypy sees a plain str.)
if TYPE_CHECKING:
    MethodName = str
else:
    MethodName = Literal[tuple(sorted(METHODS))]

# -- bounded request values (every field bounded in the OpenAPI document; see docs/API.md) ---------------------
MAX_PARAMETERS = 32  # parameters per level (global, per model, per slice, per slice source)
MAX_GRADIENT_POINTS = 64
MAX_FILTERS = 32
MAX_SLICES = 256
MAX_SLICE_SOURCES = MAX_MODELS
MAX_LAYER = 4096  # layer indices: far above any model's depth, far below any integer overflow
MAX_SEED = 2**32 - 1
MAX_EVALUATION_DATASETS = 16
NUMBER_LIMIT = 2**31 - 1  # parameter values are merge weights, densities, thresholds: small numbers

SplitName = Annotated[str, StringConstraints(max_length=64, pattern=f"^{SPLIT_PATTERN.pattern}$")]
ParameterName = Annotated[str, StringConstraints(max_length=64, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")]
Number = (
    Annotated[int, Field(ge=-NUMBER_LIMIT, le=NUMBER_LIMIT)]
    | Annotated[float, Field(ge=-NUMBER_LIMIT, le=NUMBER_LIMIT, allow_inf_nan=False)]
)
Scalar = Number | bool
Gradient = Annotated[list[Number], Field(min_length=1, max_length=MAX_GRADIENT_POINTS)]


class FilteredValue(BaseModel):
    """One entry of a filter list: the value for tensors whose name contains ``filter`` (none or ``*``: all)."""

    model_config = ConfigDict(extra="forbid")

    filter: ShortText | None = None
    value: Scalar | Gradient


ParameterValue = Scalar | Gradient | Annotated[list[FilteredValue], Field(min_length=1, max_length=MAX_FILTERS)]
# Unknown keys are refused by the schema too (pydantic writes a key pattern as patternProperties).
_CLOSED = {"additionalProperties": False}
Parameters = Annotated[dict[ParameterName, ParameterValue], Field(max_length=MAX_PARAMETERS, json_schema_extra=_CLOSED)]
LayerIndex = Annotated[int, Field(ge=0, le=MAX_LAYER)]
LayerRange = tuple[LayerIndex, LayerIndex]


class SliceSpec(BaseModel):
    """franken_merge shorthand: layers ``[start, end)`` of one model (end exclusive)."""

    model_config = ConfigDict(extra="forbid")

    model: ModelReference
    layer_range: LayerRange


class SliceSourceSpec(SliceSpec):
    parameters: Parameters = Field(default_factory=dict)


class OutputSliceSpec(BaseModel):
    """mergekit's output slice: layer ``i`` merged from layer ``start + i`` of every source."""

    model_config = ConfigDict(extra="forbid")

    sources: list[SliceSourceSpec] = Field(min_length=1, max_length=MAX_SLICE_SOURCES)
    base_model: ModelReference | None = None
    parameters: Parameters = Field(default_factory=dict)


class EvaluateSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    datasets: list[ResourceId] = Field(
        min_length=1, max_length=MAX_EVALUATION_DATASETS, description="Registered dataset ids"
    )
    split: SplitName = Field("test", description="Dataset split to evaluate on")


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

    models: list[ModelReference] = Field(
        min_length=MIN_MODELS,
        max_length=MAX_MODELS,
        description="Model ids to merge (2-8); 'base-id+adapter-id' is a registered model with a registered "
        "LoRA adapter folded in",
    )
    # A plain string for the validator (anything else is INVALID_STRATEGY, the spec's code, not a schema error),
    # an enum in the OpenAPI document (what a client may send).
    strategy: str = Field(
        max_length=64,
        description="slerp | ties | dare | task_arithmetic | franken_merge (anything else: 422 INVALID_STRATEGY)",
        json_schema_extra={"enum": list(FAMILIES)},
    )
    variant: MethodName | None = Field(
        None,
        description="A merge method of the strategy's family, by its mergekit name (GET /methods lists them). "
        "Default: the family's own method; ties with epsilon > 0 is della (DELLA's MagPrune), "
        "dare with consensus: true is dare_ties, otherwise dare_linear",
    )
    parameters: Parameters = Field(default_factory=dict, description="Strategy parameters (global)")
    output_model_id: ResourceId = Field(description="ID of the merged model; must be new")
    base_model: ModelReference | None = Field(
        None, description="Base model for task vectors (ties, dare, task_arithmetic)"
    )
    model_parameters: (
        Annotated[dict[ModelReference, Parameters], Field(max_length=MAX_MODELS + 1, json_schema_extra=_CLOSED)] | None
    ) = Field(None, description="Per-model parameters")
    slices: list[SliceSpec | OutputSliceSpec] | None = Field(
        None,
        max_length=MAX_SLICES,
        description="Output slices: franken_merge shorthand [{model, layer_range}], or mergekit's "
        "[{sources: [{model, layer_range, parameters}], parameters, base_model}] for any strategy",
    )
    dtype: OutputDtype | None = Field(None, description="Output dtype: float32 | float16 | bfloat16")
    seed: int | None = Field(None, ge=0, le=MAX_SEED, description="Seed for stochastic strategies (dare)")
    evaluate: EvaluateSpec | None = Field(None, description="Evaluate the merged model before COMPLETED")
    parallelism: int | None = Field(
        None,
        ge=1,
        le=64,
        description="Fan the merge out: up to this many groups of output shards, each a Ray task on any node, "
        "writing its shards straight to the artifact store (1: one process). Default: the server decides by "
        "the output size (merge.fanout_threshold_bytes). Bit-identical either way; not with evaluate; a recipe with "
        "tokenizer settings or LoRA inputs runs in one process",
    )

    dry_run: bool = Field(
        False,
        description="Answer 200 with the resolved plan, the compatibility verdict and the estimated peak memory, "
        "disk and wall time (a DryRunReport); no job is created",
    )

    @model_validator(mode="after")
    def _fanout_without_evaluate(self) -> MergeRequest:
        if self.parallelism and self.parallelism > 1 and self.evaluate is not None:
            raise ValueError("parallelism > 1 cannot be combined with evaluate (the output is never on one node)")
        return self

    def recipe(self) -> MergeRecipe:
        fields = self.model_dump(exclude={"output_model_id", "evaluate", "parallelism", "dry_run"}, exclude_none=True)
        return validate_recipe(MergeRecipe.from_request_fields(**fields))


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
