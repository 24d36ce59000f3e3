"""The merge recipe: what to merge, how, and into which dtype. One pydantic model shared by the CLI, the HTTP
layer (built from request fields) and evolution (candidate recipes)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from alloy.errors import AlloyError, ErrorCode
from kernels.errors import InvalidParameterError, UnknownStrategyError
from kernels.registry import StrategySpec, get_strategy, validate_parameters

OutputDtype = Literal["float32", "float16", "bfloat16"]
# A parameter value: scalar, gradient over depth, or [{filter, value}] (see kernels.params).
ParameterValue = Any

MIN_MODELS = 2
MAX_MODELS = 8


class ModelRef(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1)
    parameters: dict[str, ParameterValue] = Field(default_factory=dict)


class Slice(BaseModel):
    """Layers ``[start, end)`` of ``model`` (franken_merge)."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1)
    layer_range: tuple[int, int]

    @field_validator("layer_range")
    @classmethod
    def _ordered(cls, value: tuple[int, int]) -> tuple[int, int]:
        start, end = value
        if start < 0 or end <= start:
            raise ValueError(f"layer_range must be [start, end) with 0 <= start < end, got [{start}, {end}]")
        return value


class MergeRecipe(BaseModel):
    model_config = ConfigDict(extra="forbid")

    strategy: str
    models: list[ModelRef] = Field(default_factory=list)
    base_model: str | None = None
    parameters: dict[str, ParameterValue] = Field(default_factory=dict)
    slices: list[Slice] | None = None
    dtype: OutputDtype | None = None
    seed: int = 0

    @model_validator(mode="after")
    def _models_from_slices(self) -> "MergeRecipe":
        # A franken recipe may list only slices; its models are then the slices' models, in order of appearance.
        if not self.models and self.slices:
            seen: list[str] = []
            for piece in self.slices:
                if piece.model not in seen:
                    seen.append(piece.model)
            self.models = [ModelRef(model=m) for m in seen]
        return self

    @property
    def base(self) -> str:
        """The base model id: ``base_model`` or, by default, the first model."""
        if self.base_model:
            return self.base_model
        if not self.models:
            raise AlloyError(ErrorCode.VALIDATION_FAILED, "the recipe names no models", {"field": "models"})
        return self.models[0].model

    @property
    def model_ids(self) -> list[str]:
        """Every model the merge reads, base first when it is not among ``models``."""
        ids = [m.model for m in self.models]
        if self.strategy != "franken_merge" and self.base_model and self.base_model not in ids:
            ids.insert(0, self.base_model)
        return ids

    def model_parameters(self, model_id: str) -> dict[str, Any]:
        for ref in self.models:
            if ref.model == model_id:
                return ref.parameters
        return {}

    @classmethod
    def from_request_fields(
        cls,
        *,
        models: list[str],
        strategy: str,
        parameters: dict[str, Any] | None = None,
        base_model: str | None = None,
        model_parameters: dict[str, dict[str, Any]] | None = None,
        slices: list[dict[str, Any]] | None = None,
        dtype: str | None = None,
        seed: int | None = None,
        **_ignored: Any,
    ) -> "MergeRecipe":
        """Build (without validating the strategy) from the HTTP request's fields; unknown ids in
        ``model_parameters`` are refused. Extra fields (``output_model_id``...) are ignored."""
        model_parameters = model_parameters or {}
        stray = sorted(set(model_parameters) - set(models) - ({base_model} if base_model else set()))
        if stray:
            raise AlloyError(ErrorCode.VALIDATION_FAILED, f"model_parameters names models not in the merge: {stray}",
                             {"field": "model_parameters", "models": stray})
        try:
            return cls(
                strategy=strategy,
                models=[ModelRef(model=m, parameters=model_parameters.get(m, {})) for m in models],
                base_model=base_model,
                parameters=parameters or {},
                slices=[Slice(**s) for s in slices] if slices else None,
                dtype=dtype,
                seed=0 if seed is None else seed,
            )
        except ValueError as exc:  # pydantic's ValidationError is a ValueError
            raise recipe_validation_error(exc) from None


def recipe_validation_error(exc: Exception) -> AlloyError:
    errors = getattr(exc, "errors", None)
    if callable(errors):
        first = errors()[0]
        field = ".".join(str(p) for p in first["loc"])
        return AlloyError(ErrorCode.VALIDATION_FAILED, f"invalid recipe: {field}: {first['msg']}", {"field": field})
    return AlloyError(ErrorCode.VALIDATION_FAILED, f"invalid recipe: {exc}")


def strategy_spec(name: str) -> StrategySpec:
    try:
        return get_strategy(name)
    except UnknownStrategyError as exc:
        raise AlloyError(ErrorCode.INVALID_STRATEGY, str(exc), {"strategy": name, "known": exc.known}) from None


def parameter_error(exc: InvalidParameterError) -> AlloyError:
    return AlloyError(ErrorCode.VALIDATION_FAILED, str(exc), {"parameter": exc.param, "reason": exc.msg})


def validate_recipe(recipe: MergeRecipe) -> MergeRecipe:
    """Check everything that needs no model file; returns a copy with canonical parameter names.

    INVALID_STRATEGY for an unknown strategy; VALIDATION_FAILED (``details.parameter`` or ``details.field``)
    for bad parameters, model counts, base model or slices."""
    spec = strategy_spec(recipe.strategy)
    ids = recipe.model_ids
    if len(set(ids)) != len(ids):
        raise AlloyError(ErrorCode.VALIDATION_FAILED, "a model is listed twice", {"field": "models"})
    most = min(spec.max_models, MAX_MODELS)
    if not spec.min_models <= len(ids) <= most:
        wanted = f"exactly {most}" if spec.min_models == most else f"{spec.min_models} to {most}"
        raise AlloyError(
            ErrorCode.VALIDATION_FAILED,
            f"{recipe.strategy} takes {wanted} models (base model included), got {len(ids)}",
            {"field": "models", "count": len(ids)})
    if recipe.strategy == "franken_merge":
        _validate_slices(recipe)
    elif recipe.slices:
        raise AlloyError(ErrorCode.VALIDATION_FAILED, "slices are only used by franken_merge", {"field": "slices"})
    if recipe.base_model and recipe.strategy == "franken_merge" and recipe.base_model not in ids:
        raise AlloyError(ErrorCode.VALIDATION_FAILED, "base_model must be one of the slices' models",
                         {"field": "base_model"})
    try:
        global_params, model_params = validate_parameters(spec, recipe.parameters, [m.parameters for m in recipe.models])
    except InvalidParameterError as exc:
        raise parameter_error(exc) from None
    models = [ModelRef(model=ref.model, parameters=params) for ref, params in zip(recipe.models, model_params)]
    return recipe.model_copy(update={"parameters": global_params, "models": models})


def _validate_slices(recipe: MergeRecipe) -> None:
    if not recipe.slices:
        raise AlloyError(ErrorCode.VALIDATION_FAILED, "franken_merge needs slices", {"field": "slices"})
    listed = {m.model for m in recipe.models}
    for position, piece in enumerate(recipe.slices):
        if piece.model not in listed:
            raise AlloyError(ErrorCode.VALIDATION_FAILED, f"slice {position} uses {piece.model!r}, which is not in models",
                             {"field": f"slices.{position}.model"})
