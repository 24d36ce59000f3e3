"""Recipe files: Alloy's own YAML and mergekit's (``mergekit-yaml recipe.yml out/``), detected automatically.

A mergekit file has ``merge_method``; an Alloy file has ``strategy``. A mergekit recipe keeps mergekit's method
name (``variant``), parameter names, defaults and precedence. Every key of the file is either honoured as mergekit
honours it or refused with VALIDATION_FAILED naming it (``details.field``). A parameter the method does not read is
ignored as mergekit ignores it when mergekit knows the name, never silently: the merge result names it in a
warning (:func:`alloy.merge.recipe_checks.unread_parameter`); an unknown name is refused.

=====================  ============================================================================
mergekit key           Alloy
=====================  ============================================================================
merge_method           ``variant`` (looked up in the kernels' methods; unknown: INVALID_STRATEGY)
base_model             ``base_model`` (methods that need a base refuse a recipe without one)
models / slices        ``models`` / output ``slices`` (several slices, each with sources and parameters)
parameters             global parameters (slice source > output slice > model > global)
dtype                  ``compute_dtype`` (the maths in it, as mergekit); the output dtype follows it unless
                       ``out_dtype`` (or the method's result is float32 in mergekit: ``float32_result``)
out_dtype              ``dtype`` (the output dtype, every tensor cast to it)
tokenizer_source,      the output vocabulary, embedding rows aligned to it, the chat template
tokenizer, chat_template  (:mod:`alloy.merge.tokenizer_config`; mergekit's alpaca/exaone templates refused)
``model+adapter``      a PEFT LoRA adapter folded into the model as it is read (:mod:`alloy.merge.lora`)
modules,               refused
residual_weight
=====================  ============================================================================
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import yaml
from pydantic import TypeAdapter, ValidationError

from alloy.errors import AlloyError, ErrorCode
from alloy.merge.lora import split_reference
from alloy.merge.methods import get_method
from alloy.merge.recipe import MergeRecipe, recipe_validation_error
from alloy.merge.tokenizer_config import settings_from_mergekit

DTYPE_ALIASES = {
    "float32": "float32",
    "fp32": "float32",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
}
TOP_LEVEL_KEYS = {"merge_method", "base_model", "models", "slices", "parameters", "dtype", "out_dtype"}
TOKENIZER_KEYS = {"tokenizer_source", "tokenizer", "chat_template"}
MODEL_KEYS = {"model", "parameters"}
SLICE_KEYS = {"sources", "base_model", "parameters"}
SOURCE_KEYS = {"model", "layer_range", "parameters"}
# Keys mergekit reads that Alloy does not implement yet: refused by name rather than ignored.
NOT_SUPPORTED = {
    "modules": "per-module recipes (modules:) are not supported; use slices",
    "residual_weight": "residual_weight is not supported (mergekit 0.1.5 does not use it either)",
}


def load_recipe_yaml(text: str) -> MergeRecipe:
    """Parse a recipe file in Alloy or mergekit format (VALIDATION_FAILED when it is neither)."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise AlloyError(ErrorCode.VALIDATION_FAILED, f"recipe is not valid YAML: {_short(exc)}") from None
    if not isinstance(data, dict):
        raise AlloyError(ErrorCode.VALIDATION_FAILED, "recipe must be a YAML mapping")
    if "merge_method" in data:
        return from_mergekit(data, text)
    if "strategy" in data:
        return from_alloy(data)
    raise AlloyError(
        ErrorCode.VALIDATION_FAILED,
        "recipe has neither 'strategy' (Alloy format) nor 'merge_method' (mergekit format)",
        {"field": "strategy"},
    )


def _short(exc: yaml.YAMLError) -> str:
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or "syntax error"
    return f"{problem} at line {mark.line + 1}" if mark else problem


def from_alloy(data: dict[str, Any]) -> MergeRecipe:
    data = dict(data)
    if "mergekit_config" in data:  # set only by the mergekit reader: it switches to mergekit's names and defaults
        raise _refuse("mergekit_config", "unknown key")
    if "tokenizer" in data:  # mergekit's keys, in mergekit recipes only (one spelling, one parser)
        raise _refuse(
            "tokenizer", "tokenizer settings are mergekit recipe keys (tokenizer_source, tokenizer, chat_template)"
        )
    # Shorthand: ``models: [a, b]``.
    data["models"] = [{"model": m} if isinstance(m, str) else m for m in data.get("models") or []]
    try:
        return MergeRecipe.model_validate(data)
    except ValueError as exc:
        raise recipe_validation_error(exc) from None


def _refuse(field: str, message: str) -> AlloyError:
    return AlloyError(ErrorCode.VALIDATION_FAILED, f"{field}: {message}", {"field": field})


def _check_keys(entry: Any, allowed: set[str], field: str) -> dict[str, Any]:
    if not isinstance(entry, dict):
        raise _refuse(field, "must be a mapping")
    for key in entry:
        where = f"{field}.{key}" if field else str(key)
        if key in NOT_SUPPORTED:
            raise _refuse(where, NOT_SUPPORTED[key])
        if key not in allowed:
            raise _refuse(where, f"unknown key (known: {', '.join(sorted(allowed))})")
    return entry


def from_mergekit(data: dict[str, Any], text: str | None = None) -> MergeRecipe:
    _check_keys(data, TOP_LEVEL_KEYS | TOKENIZER_KEYS, "")
    method = get_method(str(data["merge_method"]))
    if bool(data.get("models")) == bool(data.get("slices")):
        raise _refuse("models", "exactly one of 'models' or 'slices' must be given")
    models = [_model_entry(entry, f"models.{i}") for i, entry in enumerate(data.get("models") or [])]
    slices = [_slice_entry(entry, f"slices.{k}") for k, entry in enumerate(data.get("slices") or [])] or None
    types = {p.name: p.type for p in method.params}
    for params in [m.get("parameters") for m in models] + _slice_parameter_dicts(slices) + [data.get("parameters")]:
        if isinstance(params, dict):
            for key, value in params.items():
                if key in types:
                    params[key] = _coerce(value, types[key])
    compute = _dtype(data.get("dtype"), "dtype")
    try:
        return MergeRecipe.model_validate(  # plain dicts and dtype names, validated by the model
            {
                "strategy": method.family,
                "variant": method.name,
                "models": models,
                "base_model": _model_name(data["base_model"], "base_model") if data.get("base_model") else None,
                "parameters": _params(data.get("parameters"), "parameters"),
                "slices": slices,
                # left unset without out_dtype: the plan then writes what mergekit writes (see float32_result)
                "dtype": _dtype(data.get("out_dtype"), "out_dtype"),
                "compute_dtype": compute,
                "tokenizer": settings_from_mergekit(data),
                "mergekit_config": text if text is not None else yaml.safe_dump(data, sort_keys=False),
            }
        )
    except ValueError as exc:
        raise recipe_validation_error(exc) from None


def _slice_parameter_dicts(slices: list[dict[str, Any]] | None) -> list[Any]:
    out = []
    for piece in slices or []:
        out.append(piece["parameters"])
        out += [source["parameters"] for source in piece["sources"]]
    return out


@lru_cache
def _adapter(type_: type) -> TypeAdapter:
    return TypeAdapter(type_)


def _coerce(value: Any, type_: type) -> Any:
    """A parameter value as mergekit reads it: pydantic's lax conversion of every scalar to the parameter's type
    (``normalize: 1`` is true, ``tol: "1e-5"``, which YAML reads as a string, is a number). What does not convert
    is left for validation to refuse by name."""
    if isinstance(value, list):
        return [
            dict(v, value=_coerce(v.get("value"), type_)) if isinstance(v, dict) else _coerce(v, type_) for v in value
        ]
    if isinstance(value, dict):
        return dict(value, value=_coerce(value.get("value"), type_))
    try:
        return _adapter(type_).validate_python(value)
    except ValidationError:
        return value


def _model_entry(entry: Any, field: str) -> dict[str, Any]:
    if isinstance(entry, str):
        return {"model": _model_name(entry, field)}
    _check_keys(entry, MODEL_KEYS, field)
    return {
        "model": _model_name(entry.get("model"), f"{field}.model"),
        "parameters": _params(entry.get("parameters"), f"{field}.parameters"),
    }


def _slice_entry(entry: Any, field: str) -> dict[str, Any]:
    _check_keys(entry, SLICE_KEYS, field)
    sources = entry.get("sources")
    if not isinstance(sources, list) or not sources:
        raise _refuse(f"{field}.sources", "a slice needs a list of sources")
    out: dict[str, Any] = {"sources": [], "parameters": _params(entry.get("parameters"), f"{field}.parameters")}
    if entry.get("base_model"):
        out["base_model"] = _model_name(entry["base_model"], f"{field}.base_model")
    for j, source in enumerate(sources):
        where = f"{field}.sources.{j}"
        _check_keys(source, SOURCE_KEYS, where)
        layer_range = source.get("layer_range")
        if not (
            isinstance(layer_range, list) and len(layer_range) == 2 and all(isinstance(v, int) for v in layer_range)
        ):
            raise _refuse(f"{where}.layer_range", "must be [start, end] (end exclusive)")
        out["sources"].append(
            {
                "model": _model_name(source.get("model"), f"{where}.model"),
                "layer_range": tuple(layer_range),
                "parameters": _params(source.get("parameters"), f"{where}.parameters"),
            }
        )
    return out


def _model_name(entry: Any, field: str) -> str:
    if not isinstance(entry, str) or not entry:
        raise _refuse(field, f"must be a model name or path, got {type(entry).__name__}")
    try:
        split_reference(entry)  # ``model+adapter``: checked here, the adapter itself when the merge opens it
    except AlloyError as exc:
        raise _refuse(field, exc.message) from None
    return entry


def _params(raw: Any, field: str) -> dict[str, Any]:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise _refuse(field, "parameters must be a mapping")
    return dict(raw)


def _dtype(value: Any, field: str) -> str | None:
    if value is None:
        return None
    name = DTYPE_ALIASES.get(str(value).lower())
    if name is None:
        raise _refuse(field, f"unsupported dtype {value!r} (float32, float16, bfloat16)")
    return name
