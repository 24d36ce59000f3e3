"""A merge job's request (the body of POST /merge/execute): the typed model shared by the server and the client.
Its checks against the registry and the job's creation are :mod:`alloy.jobs.merge_admission`.

Every field is bounded (lengths, list sizes, numbers, no control characters), and the OpenAPI document says so.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator

from alloy.ids import SPLIT_PATTERN, ModelReference, ResourceId, ShortText
from alloy.merge.methods import FAMILIES
from alloy.merge.recipe import MAX_MODELS, MIN_MODELS, MergeRecipe, OutputDtype, validate_recipe
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
