"""The merge recipe: what to merge, how, and into which dtype. One pydantic model shared by the CLI, the HTTP
layer (built from request fields), mergekit YAML (translated by :mod:`alloy.merge.mergekit`) and evolution.

A recipe names a ``strategy`` (one of the five HTTP families) and optionally a ``variant`` (a mergekit method name
of that family). Its layers come either from ``models`` (every layer of every model) or from output ``slices``,
each with its own sources, layer ranges and parameters (mergekit's ``slices:``); a franken merge is the case of
one source per slice. Parameter values resolve, for each input, from the slice source, the output slice, the
model entry, then the recipe's global ``parameters`` (mergekit's precedence).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from alloy.errors import AlloyError, ErrorCode
from alloy.merge.tokenizer_config import TokenizerSettings
from kernels.errors import InvalidParameterError

OutputDtype = Literal["float32", "float16", "bfloat16"]
# A parameter value: scalar, gradient over depth, or [{filter, value}] (see kernels.params).
ParameterValue = Any

MIN_MODELS = 2
MAX_MODELS = 8


class ModelRef(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1)
    parameters: dict[str, ParameterValue] = Field(default_factory=dict)


def _ordered_range(value: tuple[int, int]) -> tuple[int, int]:
    start, end = value
    if start < 0 or end <= start:
        raise ValueError(f"layer_range must be [start, end) with 0 <= start < end, got [{start}, {end}]")
    return value


class Slice(BaseModel):
    """Layers ``[start, end)`` of ``model``: the one-source output slice of a franken merge (shorthand)."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1)
    layer_range: tuple[int, int]

    @field_validator("layer_range")
    @classmethod
    def _ordered(cls, value: tuple[int, int]) -> tuple[int, int]:
        return _ordered_range(value)


class SliceSource(BaseModel):
    """One input of an output slice: layers ``[start, end)`` of ``model`` and the parameters of this input."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1)
    layer_range: tuple[int, int]
    parameters: dict[str, ParameterValue] = Field(default_factory=dict)

    @field_validator("layer_range")
    @classmethod
    def _ordered(cls, value: tuple[int, int]) -> tuple[int, int]:
        return _ordered_range(value)


class OutputSlice(BaseModel):
    """Consecutive output layers, layer ``i`` merged from layer ``start + i`` of every source."""

    model_config = ConfigDict(extra="forbid")

    sources: list[SliceSource] = Field(min_length=1)
    base_model: str | None = None
    parameters: dict[str, ParameterValue] = Field(default_factory=dict)

    @property
    def length(self) -> int:
        start, end = self.sources[0].layer_range
        return end - start

    # The first source's model and range: the whole slice of a franken merge (one source per slice).
    @property
    def model(self) -> str:
        return self.sources[0].model

    @property
    def layer_range(self) -> tuple[int, int]:
        return self.sources[0].layer_range


class MergeRecipe(BaseModel):
    model_config = ConfigDict(extra="forbid")

    strategy: str
    variant: str | None = None  # a mergekit method name of the strategy's family
    models: list[ModelRef] = Field(default_factory=list)
    base_model: str | None = None
    parameters: dict[str, ParameterValue] = Field(default_factory=dict)
    slices: list[OutputSlice] | None = None
    dtype: OutputDtype | None = None  # output dtype (mergekit's out_dtype); unset: see alloy.merge.plan
    compute_dtype: OutputDtype | None = None  # inputs are cast to it and the result rounded to it (mergekit dtype)
    seed: int = 0
    tokenizer: TokenizerSettings | None = None  # mergekit's tokenizer_source / tokenizer: / chat_template
    # The original mergekit YAML, kept for the merged folder; set only for recipes read from mergekit format, whose
    # parameter names and defaults are mergekit's (no Alloy spellings, no Alloy defaults).
    mergekit_config: str | None = None
    # Field paths of parameters mergekit accepts but the method does not read, dropped by the validation as
    # mergekit ignores them (see :func:`alloy.merge.recipe_checks.unread_parameter`); reported as warnings.
    ignored: list[str] = Field(default_factory=list)

    @field_validator("slices", mode="before")
    @classmethod
    def _franken_shorthand(cls, value: Any) -> Any:
        # ``{model, layer_range}`` (or a Slice) is a one-source output slice.
        if not isinstance(value, list):
            return value
        out = []
        for entry in value:
            if isinstance(entry, Slice):
                entry = entry.model_dump()
            if isinstance(entry, dict) and "model" in entry and "sources" not in entry:
                entry = {"sources": [entry]}
            out.append(entry)
        return out

    @model_validator(mode="after")
    def _models_from_slices(self) -> MergeRecipe:
        # A sliced recipe may list only slices; its models are then the slices' models, in order of appearance.
        if not self.models and self.slices:
            seen: list[str] = []
            for piece in self.slices:
                for source in piece.sources:
                    if source.model not in seen:
                        seen.append(source.model)
            self.models = [ModelRef(model=m) for m in seen]
        return self

    @property
    def is_mergekit(self) -> bool:
        return self.mergekit_config is not None

    @property
    def base(self) -> str:
        """The base model id: ``base_model`` or, for Alloy-native recipes, the first model."""
        if self.base_model:
            return self.base_model
        if not self.models:
            raise AlloyError(ErrorCode.VALIDATION_FAILED, "the recipe names no models", {"field": "models"})
        return self.models[0].model

    @property
    def default_base(self) -> str | None:
        """The base of slices that name none: mergekit has none unless ``base_model`` is set."""
        if self.base_model or not self.is_mergekit:
            return self.base
        return None

    @property
    def model_ids(self) -> list[str]:
        """Every model the merge reads, base first when it is not among ``models``."""
        ids = [m.model for m in self.models]
        for piece in self.slices or []:
            for model in [s.model for s in piece.sources] + ([piece.base_model] if piece.base_model else []):
                if model not in ids:
                    ids.append(model)
        if not self.slices and self.base_model and self.base_model not in ids:
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
        variant: str | None = None,
        parameters: dict[str, Any] | None = None,
        base_model: str | None = None,
        model_parameters: dict[str, dict[str, Any]] | None = None,
        slices: list[dict[str, Any]] | None = None,
        dtype: str | None = None,
        seed: int | None = None,
        **_ignored: Any,
    ) -> MergeRecipe:
        """Build (without validating the strategy) from the HTTP request's fields; unknown ids in
        ``model_parameters`` are refused. Extra fields (``output_model_id``...) are ignored."""
        model_parameters = model_parameters or {}
        stray = sorted(set(model_parameters) - set(models) - ({base_model} if base_model else set()))
        if stray:
            raise AlloyError(
                ErrorCode.VALIDATION_FAILED,
                f"model_parameters names models not in the merge: {stray}",
                {"field": "model_parameters", "models": stray},
            )
        try:
            return cls.model_validate(  # slices as plain dicts and the dtype's name, validated by the model
                {
                    "strategy": strategy,
                    "variant": variant,
                    "models": [ModelRef(model=m, parameters=model_parameters.get(m, {})) for m in models],
                    "base_model": base_model,
                    "parameters": parameters or {},
                    "slices": slices or None,
                    "dtype": dtype,
                    "seed": 0 if seed is None else seed,
                }
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


def parameter_error(exc: InvalidParameterError, field: str | None = None) -> AlloyError:
    details = {"parameter": exc.param, "reason": exc.msg}
    if field:
        details["field"] = field
    return AlloyError(ErrorCode.VALIDATION_FAILED, str(exc) if not field else f"{field}: {exc}", details)


def validate_recipe(recipe: MergeRecipe) -> MergeRecipe:
    """Check everything that needs no model file; returns the canonical recipe: ``variant`` set to the method,
    parameters under the method's (mergekit's) names. See :mod:`alloy.merge.recipe_checks`."""
    from alloy.merge.recipe_checks import canonical_recipe

    return canonical_recipe(recipe)
