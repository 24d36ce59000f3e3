"""Recipe files: Alloy's own YAML and mergekit's (``mergekit-yaml recipe.yml out/``), detected automatically.

A mergekit file has ``merge_method``; an Alloy file has ``strategy``. The mergekit mapping (also in the README, "Merging"):

=================  ==========================================================================
mergekit           Alloy
=================  ==========================================================================
linear             linear
slerp              slerp (``base_model`` at t=0)
task_arithmetic    task_arithmetic
ties               ties (mergekit's density default 1.0 is kept when density is not given)
dare_ties          dare with ``consensus: true``; ``density`` -> ``drop_rate = 1 - density``
dare_linear        dare with ``consensus: false``; same density mapping
passthrough        franken_merge (one source per slice)
=================  ==========================================================================
"""

from __future__ import annotations

import logging
from typing import Any

import yaml

from alloy.errors import AlloyError, ErrorCode
from alloy.merge.recipe import MergeRecipe, ModelRef, Slice, recipe_validation_error

log = logging.getLogger(__name__)

METHOD_MAP: dict[str, tuple[str, dict[str, Any]]] = {
    "linear": ("linear", {}),
    "slerp": ("slerp", {}),
    "task_arithmetic": ("task_arithmetic", {}),
    "ties": ("ties", {}),
    "dare_ties": ("dare", {"consensus": True}),
    "dare_linear": ("dare", {"consensus": False}),
    "passthrough": ("franken_merge", {}),
}
# mergekit defaults that differ from Alloy's, made explicit when the file does not set them.
MERGEKIT_DEFAULTS: dict[str, dict[str, Any]] = {
    "ties": {"density": 1.0},
    "dare": {"drop_rate": 0.0},
}
DTYPE_ALIASES = {"float32": "float32", "fp32": "float32", "float16": "float16", "fp16": "float16",
                 "half": "float16", "bfloat16": "bfloat16", "bf16": "bfloat16"}
BOOL_PARAMS = {"normalize", "rescale", "consensus"}
DROPPED_PARAMS = {"int8_mask"}  # mergekit memory tweaks with no effect on the result
IGNORED_KEYS = {"tokenizer_source", "tokenizer", "chat_template", "name", "out_dtype", "dtype", "merge_method",
                "base_model", "models", "parameters", "slices", "seed"}


def load_recipe_yaml(text: str) -> MergeRecipe:
    """Parse a recipe file in Alloy or mergekit format (VALIDATION_FAILED when it is neither)."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise AlloyError(ErrorCode.VALIDATION_FAILED, f"recipe is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise AlloyError(ErrorCode.VALIDATION_FAILED, "recipe must be a YAML mapping")
    if "merge_method" in data:
        return from_mergekit(data)
    if "strategy" in data:
        return from_alloy(data)
    raise AlloyError(ErrorCode.VALIDATION_FAILED,
                     "recipe has neither 'strategy' (Alloy format) nor 'merge_method' (mergekit format)",
                     {"field": "strategy"})


def from_alloy(data: dict[str, Any]) -> MergeRecipe:
    data = dict(data)
    # Shorthand: ``models: [a, b]``.
    data["models"] = [{"model": m} if isinstance(m, str) else m for m in data.get("models") or []]
    try:
        return MergeRecipe.model_validate(data)
    except ValueError as exc:
        raise recipe_validation_error(exc) from None


def from_mergekit(data: dict[str, Any]) -> MergeRecipe:
    method = data["merge_method"]
    if method not in METHOD_MAP:
        raise AlloyError(ErrorCode.INVALID_STRATEGY,
                         f"mergekit merge_method {method!r} has no Alloy equivalent; supported: {', '.join(METHOD_MAP)}",
                         {"strategy": method, "known": sorted(METHOD_MAP)})
    strategy, implied = METHOD_MAP[method]
    for key in sorted(set(data) - IGNORED_KEYS):
        log.warning("mergekit key %r is not used by Alloy", key)
    for key in ("tokenizer_source", "tokenizer", "chat_template"):
        if key in data:
            log.warning("mergekit %s is not supported: tokenizer files are copied from the base model", key)

    global_params = {**_params(data.get("parameters"), method), **implied}
    for key, value in MERGEKIT_DEFAULTS.get(strategy, {}).items():
        global_params.setdefault(key, value)
    models = [ModelRef(model=_model_name(m), parameters=_params(m.get("parameters") if isinstance(m, dict) else None, method))
              for m in data.get("models") or []]
    slices = None
    if data.get("slices"):
        models, slices, slice_params = _slices(data["slices"], strategy, models, method)
        global_params = {**slice_params, **global_params}
    try:
        return MergeRecipe(
            strategy=strategy,
            models=models,
            base_model=_model_name(data["base_model"]) if data.get("base_model") else None,
            parameters=global_params,
            slices=slices,
            dtype=_dtype(data.get("out_dtype") or data.get("dtype")),
            seed=int(data.get("seed", 0)),
        )
    except ValueError as exc:
        raise recipe_validation_error(exc) from None


def _model_name(entry: Any) -> str:
    if isinstance(entry, dict):
        entry = entry.get("model")
    if not isinstance(entry, str) or not entry:
        raise AlloyError(ErrorCode.VALIDATION_FAILED, f"model must be a name or path, got {entry!r}", {"field": "models"})
    if "+" in entry:
        raise AlloyError(ErrorCode.VALIDATION_FAILED, f"LoRA-merged model references ({entry!r}) are not supported",
                         {"field": "models"})
    return entry


def _dtype(value: Any) -> str | None:
    if value is None:
        return None
    name = DTYPE_ALIASES.get(str(value).lower())
    if name is None:
        raise AlloyError(ErrorCode.VALIDATION_FAILED, f"unsupported dtype {value!r}", {"field": "dtype"})
    return name


def _params(raw: Any, method: str) -> dict[str, Any]:
    """mergekit parameter names and values -> Alloy's."""
    if not raw:
        return {}
    if not isinstance(raw, dict):
        raise AlloyError(ErrorCode.VALIDATION_FAILED, "parameters must be a mapping", {"field": "parameters"})
    out: dict[str, Any] = {}
    for key, value in raw.items():
        if key in DROPPED_PARAMS:
            continue
        if key in BOOL_PARAMS:
            value = _map_values(value, lambda v: bool(v) if isinstance(v, (int, float)) else v)
        if key == "density" and method in ("dare_ties", "dare_linear"):
            key, value = "drop_rate", _map_values(value, _drop_rate)
        out[key] = value
    return out


def _drop_rate(density: Any) -> Any:
    return round(1.0 - float(density), 12) if isinstance(density, (int, float)) and not isinstance(density, bool) else density


def _map_values(value: Any, fn) -> Any:
    """Apply ``fn`` to every scalar of a scalar, gradient or filter list."""
    if isinstance(value, list):
        return [dict(v, value=_map_values(v.get("value"), fn)) if isinstance(v, dict) else fn(v) for v in value]
    return fn(value)


def _slices(raw: list[Any], strategy: str, models: list[ModelRef], method: str):
    """mergekit ``slices``: for passthrough, one source per slice -> franken slices; for any other method, a single
    slice whose sources all share one layer_range (the usual way slerp recipes are written) -> models."""
    parsed = []
    for position, entry in enumerate(raw):
        sources = entry.get("sources") if isinstance(entry, dict) else None
        if not sources:
            raise AlloyError(ErrorCode.VALIDATION_FAILED, f"slice {position} has no sources", {"field": f"slices.{position}"})
        parsed.append(sources)
    if strategy == "franken_merge":
        slices = []
        for position, sources in enumerate(parsed):
            if len(sources) != 1:
                raise AlloyError(ErrorCode.VALIDATION_FAILED,
                                 f"passthrough slice {position} must have exactly one source", {"field": f"slices.{position}"})
            slices.append(Slice(model=_model_name(sources[0]), layer_range=tuple(sources[0]["layer_range"])))
        return models, slices, {}
    if len(parsed) != 1 or len({tuple(s.get("layer_range") or ()) for s in parsed[0]}) != 1:
        raise AlloyError(ErrorCode.VALIDATION_FAILED,
                         f"{method} with slices is supported for one slice whose sources share a layer_range "
                         "covering the whole models", {"field": "slices"})
    slice_params = _params(raw[0].get("parameters"), method)
    slice_models = [ModelRef(model=_model_name(s), parameters=_params(s.get("parameters"), method)) for s in parsed[0]]
    return slice_models, None, slice_params
