"""Validation of a recipe without any model file: the method, every parameter at every level, the inputs of
every output slice and their base. Alloy-native spellings (``drop_rate``, ``consensus``, ``scale`` for
``lambda``, ties ``epsilon``) and Alloy's documented defaults become the method's own parameters here, once; a
recipe read from mergekit YAML keeps mergekit's names and defaults. A parameter its method does not declare is
handled by :func:`unread_parameter`, the one rule for it: mergekit ignores it, so Alloy does too when mergekit knows
the name (another of its methods reads it, e.g. ``weight`` on slerp), but never silently: the key is dropped and
named in ``MergeRecipe.ignored`` (a warning in the merge result and the CLI output). A name no mergekit method
knows (a typo) is refused with VALIDATION_FAILED naming the key, as is any unknown key of an Alloy-native recipe."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from alloy.errors import AlloyError, ErrorCode
from alloy.merge.methods import get_method, is_shared, resolve_variant, uses_base
from alloy.merge.recipe import MAX_MODELS, MIN_MODELS, MergeRecipe, ModelRef, OutputSlice, SliceSource, parameter_error
from kernels.errors import InvalidParameterError
from kernels.params import is_filter_list, scalar_points
from kernels.registry import ALLOY_ONLY_METHODS, METHODS

# Every parameter name some mergekit 0.1.5 method declares: what mergekit "knows" (and ignores elsewhere).
MERGEKIT_PARAMETERS = frozenset(p.name for m in METHODS.values() if m.name not in ALLOY_ONLY_METHODS for p in m.params)

# Alloy's documented defaults where mergekit's differ (or mergekit has none): applied to Alloy-native recipes only.
# By family; only to parameters the method declares (nearswap's t, a threshold in another family, gets none).
ALLOY_DEFAULTS: dict[str, dict[str, Any]] = {
    "*": {"weight": 1.0},
    "slerp": {"t": 0.5},
    "ties": {"density": 0.5},
    "dare": {"density": 0.5},  # drop_rate 0.5
}


def canonical_recipe(recipe: MergeRecipe) -> MergeRecipe:
    if recipe.is_mergekit:
        method = get_method(recipe.variant or recipe.strategy)
        recipe = recipe.model_copy(deep=True)  # unread parameters are dropped from this copy's levels
    else:
        method = resolve_variant(recipe.strategy, recipe.variant, recipe.parameters)
        recipe = _alloy_spellings(recipe, method)
    _check_models(recipe, method)
    _check_groups(recipe, method)
    ignored: list[str] = []
    for field, params, shared_allowed in parameter_levels(recipe):
        for key in [k for k in params if unread_parameter(recipe, method, k)]:
            del params[key]  # the levels are the copy's own dicts (see below)
            ignored.append(f"{field}.{key}")
        _check_params(method, field, params, shared_allowed)
    return recipe.model_copy(
        update={"variant": method.name, "strategy": method.family, "ignored": [*recipe.ignored, *ignored]}
    )


def unread_parameter(recipe: MergeRecipe, method: Any, key: str) -> bool:
    """Whether ``key`` is a parameter the recipe's method does not read and that is nevertheless merged without
    it, as mergekit does: only in a mergekit recipe, and only for a name mergekit knows. Anything else the method
    does not declare is refused by the parameter check (VALIDATION_FAILED naming the key)."""
    declared = any(p.name == key for p in method.params)
    return recipe.is_mergekit and not declared and key in MERGEKIT_PARAMETERS


def parameter_levels(recipe: MergeRecipe) -> Iterator[tuple[str, dict[str, Any], bool]]:
    """``(field path, parameters, may hold shared parameters)`` of every level of the recipe."""
    yield "parameters", recipe.parameters, True
    for i, ref in enumerate(recipe.models):
        yield f"models.{i}.parameters", ref.parameters, False
    for k, piece in enumerate(recipe.slices or []):
        yield f"slices.{k}.parameters", piece.parameters, True
        for j, source in enumerate(piece.sources):
            yield f"slices.{k}.sources.{j}.parameters", source.parameters, False


def ignored_warnings(recipe: MergeRecipe) -> list[str]:
    """One line per parameter the validated recipe ignored, naming its field."""
    method = recipe.variant or recipe.strategy
    return [f"{field}: not read by {method}; ignored, as mergekit ignores it" for field in recipe.ignored]


def _param(method: Any, name: str):
    for spec in method.params:
        if spec.name == name:
            return spec
    known = ", ".join(p.name for p in method.params) or "none"
    raise InvalidParameterError(name, f"unknown parameter for {method.name} (known: {known})")


def _check_params(method: Any, field: str, params: dict[str, Any], shared_allowed: bool) -> None:
    for key, value in params.items():
        try:
            spec = _param(method, key)
            if is_shared(spec) and not shared_allowed:
                raise InvalidParameterError(
                    key, f"is one value for all inputs of {method.name}: set it in the recipe's or a slice's parameters"
                )
            spec.check(value)
        except InvalidParameterError as exc:
            raise parameter_error(exc, f"{field}.{key}") from None


# --- inputs -------------------------------------------------------------------------------------------------


def slice_base(recipe: MergeRecipe, piece: OutputSlice) -> str | None:
    """The base of one output slice: its own, the recipe's, or (Alloy-native only) its first source."""
    if piece.base_model or recipe.base_model:
        return piece.base_model or recipe.base_model
    return None if recipe.is_mergekit else piece.sources[0].model


def models_base(recipe: MergeRecipe) -> str | None:
    """The base of a ``models:`` recipe (mergekit adds it to the inputs when it is not among them)."""
    return recipe.base_model or (None if recipe.is_mergekit else recipe.models[0].model if recipe.models else None)


def _check_models(recipe: MergeRecipe, method: Any) -> None:
    ids = [m.model for m in recipe.models]
    if len(set(ids)) != len(ids):
        raise AlloyError(ErrorCode.VALIDATION_FAILED, "a model is listed twice", {"field": "models"})
    if len(recipe.model_ids) > MAX_MODELS:
        raise AlloyError(
            ErrorCode.VALIDATION_FAILED,
            f"a merge reads at most {MAX_MODELS} models, got {len(recipe.model_ids)}",
            {"field": "models", "count": len(recipe.model_ids)},
        )
    if not recipe.is_mergekit and method.family != "franken_merge" and len(recipe.model_ids) < MIN_MODELS:
        # the service's rule (a merge of one model is a copy); mergekit recipes keep mergekit's contract
        raise AlloyError(
            ErrorCode.VALIDATION_FAILED,
            f"a merge takes {MIN_MODELS} to {MAX_MODELS} models, got {len(recipe.model_ids)}",
            {"field": "models", "count": len(recipe.model_ids)},
        )
    if not recipe.models and not recipe.slices:
        raise AlloyError(ErrorCode.VALIDATION_FAILED, "the recipe names no models", {"field": "models"})
    if method.family == "franken_merge" and not recipe.slices and not recipe.is_mergekit:
        raise AlloyError(ErrorCode.VALIDATION_FAILED, "franken_merge needs slices", {"field": "slices"})


def _check_groups(recipe: MergeRecipe, method: Any) -> None:
    """Every group of inputs merged together (the models, or each output slice's sources) suits the method."""
    if not recipe.slices:
        inputs = recipe.model_ids
        _check_inputs(method, inputs, models_base(recipe), "models", "base_model")
        return
    for k, piece in enumerate(recipe.slices):
        inputs = [s.model for s in piece.sources]
        if len(set(inputs)) != len(inputs):
            raise AlloyError(
                ErrorCode.VALIDATION_FAILED, f"slice {k} lists a model twice", {"field": f"slices.{k}.sources"}
            )
        lengths = {s.layer_range[1] - s.layer_range[0] for s in piece.sources}
        if len(lengths) != 1:
            raise AlloyError(
                ErrorCode.VALIDATION_FAILED,
                f"the sources of slice {k} must have the same number of layers",
                {"field": f"slices.{k}.sources"},
            )
        _check_inputs(
            method,
            inputs,
            slice_base(recipe, piece),
            f"slices.{k}.sources",
            f"slices.{k}.base_model" if piece.base_model else "base_model",
        )


def _check_inputs(method: Any, inputs: list[str], base: str | None, field: str, base_field: str) -> None:
    """mergekit's input contract: a base it uses must be one of the inputs; counts with and without it."""
    if base is not None and uses_base(method) and base not in inputs:
        raise AlloyError(
            ErrorCode.VALIDATION_FAILED,
            f"base model {base!r} is not among the inputs of {field}",
            {"field": base_field},
        )
    try:
        method.check_inputs(len(inputs), base is not None and base in inputs)
    except InvalidParameterError as exc:
        where = base_field if exc.param == "base_model" else field
        raise AlloyError(
            ErrorCode.VALIDATION_FAILED, f"{exc.msg} (in {where})", {"field": where, "count": len(inputs)}
        ) from None


# --- Alloy-native spellings ------------------------------------------------------------------------------------


def _alloy_spellings(recipe: MergeRecipe, method: Any) -> MergeRecipe:
    names = {p.name for p in method.params}

    def translate(params: dict[str, Any], field: str) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in params.items():
            new_key, new_value = key, value
            if key == "drop_rate" and method.family == "dare":
                new_key, new_value = "density", _map_points(value, lambda v: round(1.0 - float(v), 12))
            elif key == "consensus" and method.family == "dare":
                wanted = method.name == "dare_ties"
                if value is not wanted:
                    raise AlloyError(
                        ErrorCode.VALIDATION_FAILED,
                        f"consensus: {value} contradicts variant {method.name}",
                        {"field": f"{field}.{key}"},
                    )
                continue
            elif key == "epsilon" and method.family == "ties" and "epsilon" not in names:
                if _all_zero(value):
                    continue
                raise AlloyError(
                    ErrorCode.VALIDATION_FAILED,
                    f"{method.name} has no epsilon (epsilon > 0 is DELLA's MagPrune: variant della)",
                    {"field": f"{field}.{key}", "parameter": key},
                )
            elif key == "scale" and "scale" not in names and "lambda" in names:
                new_key = "lambda"
            if new_key in out:
                raise AlloyError(
                    ErrorCode.VALIDATION_FAILED,
                    f"{new_key} given twice ({key!r} is an alias)",
                    {"field": f"{field}.{key}", "parameter": key},
                )
            out[new_key] = new_value
        return out

    defaults = {**ALLOY_DEFAULTS["*"], **ALLOY_DEFAULTS.get(method.family, {})}
    parameters = translate(recipe.parameters, "parameters")
    for key, value in defaults.items():
        if key in names:
            parameters.setdefault(key, value)
    models = [
        ModelRef(model=m.model, parameters=translate(m.parameters, f"models.{i}.parameters"))
        for i, m in enumerate(recipe.models)
    ]
    slices = None
    if recipe.slices:
        slices = [
            OutputSlice(
                base_model=piece.base_model,
                parameters=translate(piece.parameters, f"slices.{k}.parameters"),
                sources=[
                    SliceSource(
                        model=s.model,
                        layer_range=s.layer_range,
                        parameters=translate(s.parameters, f"slices.{k}.sources.{j}.parameters"),
                    )
                    for j, s in enumerate(piece.sources)
                ],
            )
            for k, piece in enumerate(recipe.slices)
        ]
    return recipe.model_copy(update={"parameters": parameters, "models": models, "slices": slices})


def _map_points(value: Any, fn) -> Any:
    """Apply ``fn`` to every number of a scalar, gradient or filter list."""
    if is_filter_list(value):
        return [dict(entry, value=_map_points(entry["value"], fn)) for entry in value]
    if isinstance(value, list):
        return [fn(v) if _number(v) else v for v in value]
    return fn(value) if _number(value) else value


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _all_zero(value: Any) -> bool:
    try:
        return all(_number(p) and p == 0 for p in scalar_points(value))
    except ValueError:
        return False
