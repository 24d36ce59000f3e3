"""The strategies and the parameters each declares; validation and per-tensor resolution of parameter values."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from kernels import dare, linear, slerp, task_arithmetic, ties
from kernels.errors import InvalidParameterError, UnknownStrategyError
from kernels.params import is_filter_list, is_gradient, is_scalar, resolve_value, scalar_points

Scope = Literal["global", "per_model"]
Kernel = Callable[..., Any]  # (tensors, base_index, global_params, model_params, generator) -> float32 tensor


@dataclass(frozen=True)
class ParamSpec:
    name: str
    type: type  # float or bool
    default: float | bool
    scope: Scope
    minimum: float | None = None
    maximum: float | None = None
    aliases: tuple[str, ...] = ()
    description: str = ""

    def check(self, value: Any) -> None:
        """Raise InvalidParameterError unless ``value`` is a legal scalar, gradient or filter list for this spec."""
        if self.type is bool:
            legal_form = isinstance(value, bool) or (
                is_filter_list(value) and all(isinstance(e["value"], bool) for e in value))
            if not legal_form:
                raise InvalidParameterError(self.name, f"expected true/false (or a filter list of them), got {value!r}")
        else:
            if not (is_scalar(value) or is_gradient(value) or is_filter_list(value)):
                raise InvalidParameterError(
                    self.name, f"expected a number, a gradient list of numbers or a filter list, got {value!r}")
            if is_filter_list(value):
                for entry in value:
                    if not (entry.get("filter") is None or isinstance(entry["filter"], str)):
                        raise InvalidParameterError(self.name, f"filter must be a string, got {entry['filter']!r}")
                    if not ((is_scalar(entry["value"]) and not isinstance(entry["value"], bool))
                            or is_gradient(entry["value"])):
                        raise InvalidParameterError(self.name, f"filter value must be a number or gradient, got {entry['value']!r}")
            for point in scalar_points(value):
                if isinstance(point, bool):
                    raise InvalidParameterError(self.name, f"expected a number, got {point!r}")
                self._check_range(float(point))

    def _check_range(self, number: float) -> None:
        if not math.isfinite(number):
            raise InvalidParameterError(self.name, f"must be finite, got {number}")
        if self.minimum is not None and number < self.minimum:
            raise InvalidParameterError(self.name, f"must be >= {self.minimum}, got {number}")
        if self.maximum is not None and number > self.maximum:
            raise InvalidParameterError(self.name, f"must be <= {self.maximum}, got {number}")


@dataclass(frozen=True)
class StrategySpec:
    name: str
    description: str
    params: tuple[ParamSpec, ...]
    kernel: Kernel | None  # None for franken_merge, which moves tensors instead of computing them
    min_models: int = 2
    max_models: int = 8
    uses_base: bool = True
    random: bool = False  # draws from the per-tensor generator
    param_index: dict[str, ParamSpec] = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        index = {}
        for spec in self.params:
            for key in (spec.name, *spec.aliases):
                index[key] = spec
        object.__setattr__(self, "param_index", index)

    def param(self, name: str) -> ParamSpec:
        spec = self.param_index.get(name)
        if spec is None:
            known = ", ".join(p.name for p in self.params) or "none"
            raise InvalidParameterError(name, f"unknown parameter for {self.name} (known: {known})")
        return spec


def _weight() -> ParamSpec:
    return ParamSpec("weight", float, 1.0, "per_model", -100.0, 100.0, description="weight of the model's task vector")


def _lambda() -> ParamSpec:
    return ParamSpec("lambda", float, 1.0, "global", -100.0, 100.0, aliases=("scale",),
                     description="scale of the merged task vector")


STRATEGIES: dict[str, StrategySpec] = {
    "slerp": StrategySpec(
        "slerp", "spherical interpolation of exactly two models; the base at t=0",
        (ParamSpec("t", float, 0.5, "global", 0.0, 1.0, description="interpolation factor"),),
        slerp.merge, min_models=2, max_models=2),
    "linear": StrategySpec(
        "linear", "weighted average of the models",
        (_weight(), ParamSpec("normalize", bool, True, "global", description="divide by the sum of weights")),
        linear.merge, uses_base=False),
    "task_arithmetic": StrategySpec(
        "task_arithmetic", "base + lambda * sum(w_i * (x_i - base))",
        (_weight(), _lambda(), ParamSpec("normalize", bool, False, "global")),
        task_arithmetic.merge),
    "ties": StrategySpec(
        "ties", "trim task vectors to the top density by magnitude, elect signs, disjoint mean",
        (ParamSpec("density", float, 0.5, "per_model", 0.0, 1.0, description="fraction of each task vector kept"),
         ParamSpec("epsilon", float, 0.0, "per_model", 0.0, 0.5,
                   description="> 0: magnitude-ranked stochastic pruning with keep probability density ± epsilon"),
         _weight(), _lambda(), ParamSpec("normalize", bool, True, "global")),
        ties.merge, random=True),
    "dare": StrategySpec(
        "dare", "drop task-vector entries at random, rescale, then task arithmetic or TIES consensus",
        (ParamSpec("drop_rate", float, 0.5, "per_model", 0.0, 1.0, description="probability of dropping an entry"),
         ParamSpec("rescale", bool, True, "global", description="multiply survivors by 1/(1-drop_rate)"),
         ParamSpec("consensus", bool, False, "global", description="TIES sign consensus instead of a plain sum"),
         _weight(), _lambda(), ParamSpec("normalize", bool, False, "global")),
        dare.merge, random=True),
    "franken_merge": StrategySpec(
        "franken_merge", "stack layer slices of the models (mergekit passthrough)", (), None,
        min_models=1, max_models=8, uses_base=False),
}


def get_strategy(name: str) -> StrategySpec:
    spec = STRATEGIES.get(name)
    if spec is None:
        raise UnknownStrategyError(name, sorted(STRATEGIES))
    return spec


def canonical_params(spec: StrategySpec, params: Mapping[str, Any], *, per_model: bool) -> dict[str, Any]:
    """Validate one parameter mapping and return it under canonical names (``scale`` -> ``lambda``).
    Per-model parameters may also be given globally (as the default for every model), not the reverse."""
    out: dict[str, Any] = {}
    for key, value in params.items():
        param = spec.param(key)
        if per_model and param.scope == "global":
            raise InvalidParameterError(key, f"is a global parameter of {spec.name}; set it in the recipe's parameters")
        if param.name in out:
            raise InvalidParameterError(key, f"given twice (as {param.name!r} and an alias)")
        param.check(value)
        out[param.name] = value
    return out


def validate_parameters(spec: StrategySpec, global_params: Mapping[str, Any],
                        model_params: Sequence[Mapping[str, Any]]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Check every parameter's name, scope, form and range; return the canonical mappings."""
    canonical_global = canonical_params(spec, global_params, per_model=False)
    canonical_models = [canonical_params(spec, p, per_model=True) for p in model_params]
    return canonical_global, canonical_models


def resolve_for_tensor(spec: StrategySpec, global_params: Mapping[str, Any], model_params: Sequence[Mapping[str, Any]],
                       tensor_name: str, t: float) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Scalars for one tensor: per-model value, else global value, else the default (canonical names expected)."""
    resolved_global: dict[str, Any] = {}
    resolved_models: list[dict[str, Any]] = [{} for _ in model_params]
    for param in spec.params:
        fallback = _resolved(param, global_params.get(param.name), tensor_name, t, param.default)
        if param.scope == "global":
            resolved_global[param.name] = fallback
            continue
        for mine, theirs in zip(resolved_models, model_params):
            mine[param.name] = _resolved(param, theirs.get(param.name), tensor_name, t, fallback)
    return resolved_global, resolved_models


def _resolved(param: ParamSpec, value: Any, tensor_name: str, t: float, fallback: Any) -> Any:
    if value is None:
        return fallback
    scalar = resolve_value(value, tensor_name, t)
    if scalar is None:
        return fallback
    return bool(scalar) if param.type is bool else float(scalar)
