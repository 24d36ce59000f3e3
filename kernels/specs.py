"""What a merge method declares: its parameters (name, type, default, scope, range) and its input contract.

The declarations themselves live in :mod:`kernels.registry` (mergekit's methods) and :mod:`kernels.alloy_methods`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from kernels.errors import InvalidParameterError
from kernels.params import is_filter_list, is_gradient, is_scalar, scalar_points

# "global": one value per tensor (mergekit's SHARED scope); "per_model": one value per model other than the base
# (mergekit's NON_BASE); "input": one value per
# input model, the base included (mergekit's INPUT: linear's weight, passthrough's scale).
Scope = Literal["global", "per_model", "input"]
Kernel = Callable[..., Any]  # (tensors, base_index, global_params, model_params, generator, owned[, dtype]) -> tensor


@dataclass(frozen=True)
class ParamSpec:
    name: str
    type: type  # float, int or bool
    default: float | int | bool | None  # None: no value (a required parameter, or passthrough's optional scale)
    scope: Scope
    minimum: float | None = None
    maximum: float | None = None
    aliases: tuple[str, ...] = ()
    description: str = ""
    required: bool = False  # mergekit refuses a merge that leaves it unset (for a non-base model, if per model)

    def check(self, value: Any) -> None:
        """Raise InvalidParameterError unless ``value`` is a legal scalar, gradient or filter list for this spec."""
        if self.type is int:
            if not (isinstance(value, int) and not isinstance(value, bool)):
                raise InvalidParameterError(self.name, f"expected a whole number, got {value!r}")
            self._check_range(float(value))
        elif self.type is bool:
            legal_form = isinstance(value, bool) or (
                is_filter_list(value) and all(isinstance(e["value"], bool) for e in value)
            )
            if not legal_form:
                raise InvalidParameterError(self.name, f"expected true/false (or a filter list of them), got {value!r}")
        else:
            if not (is_scalar(value) or is_gradient(value) or is_filter_list(value)):
                raise InvalidParameterError(
                    self.name, f"expected a number, a gradient list of numbers or a filter list, got {value!r}"
                )
            if is_filter_list(value):
                for entry in value:
                    if not (entry.get("filter") is None or isinstance(entry["filter"], str)):
                        raise InvalidParameterError(self.name, f"filter must be a string, got {entry['filter']!r}")
                    if not (
                        (is_scalar(entry["value"]) and not isinstance(entry["value"], bool))
                        or is_gradient(entry["value"])
                    ):
                        raise InvalidParameterError(
                            self.name, f"filter value must be a number or gradient, got {entry['value']!r}"
                        )
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


# --- mergekit 0.1.5 methods ----------------------------------------------------------------------------------

Family = Literal["slerp", "ties", "dare", "task_arithmetic", "franken_merge"]  # the HTTP strategies
BasePolicy = Literal["required", "optional", "ignored"]


@dataclass(frozen=True)
class MethodSpec:
    """A mergekit merge method: its parameters (names, defaults and scopes as mergekit 0.1.5 declares them), its
    kernel, and the inputs it takes. ``min_models``/``max_models`` count every input, the base included;
    ``min_non_base``/``max_non_base`` count the others. ``uses_base``: the kernel reads a base when there is one;
    ``requires_base``: it needs one. ``family``: the HTTP strategy it is a variant of."""

    name: str
    description: str
    params: tuple[ParamSpec, ...]
    kernel: Kernel
    min_models: int = 2
    max_models: int = 8
    uses_base: bool = True
    random: bool = False  # draws from the per-tensor generator
    family: Family = "task_arithmetic"
    base: BasePolicy = "required"
    min_non_base: int | None = None
    max_non_base: int | None = None
    reference: str = ""
    # mergekit computes the method in the recipe's dtype, op for op, and the kernel can too: it takes ``dtype``
    # (bfloat16, float16) and returns a tensor of it. Otherwise the kernel computes in float32 from inputs rounded
    # to that dtype, and its result is rounded to it.
    computes_in_dtype: bool = False
    # mergekit's result is float32 whatever the dtype it computes in: the method multiplies by a float32 mask or
    # scale (arcee_fusion's ``(importance >= threshold).float()``, ramplus_tl's counts divided), type promotion
    # makes the result float32, and mergekit writes a tensor in the dtype its method returned unless the recipe
    # sets ``out_dtype``. The kernel (``computes_in_dtype``) returns float32 too; the plan gives a mergekit recipe
    # without ``out_dtype`` float32 output tensors from it.
    float32_result: bool = False
    # The kernel's time is in LAPACK factorisations (an SVD per 2-D tensor), which spread one tensor over torch's
    # intra-op threads. Every other kernel is elementwise or a sort: one intra-op thread per merge thread is as
    # fast and spares the spinning of idle ones (alloy.merge.threads, where it was measured).
    threaded_kernel: bool = False
    param_index: dict[str, ParamSpec] = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        index = {}
        for spec in self.params:
            for key in (spec.name, *spec.aliases):
                index[key] = spec
        object.__setattr__(self, "param_index", index)

    def param(self, name: str) -> ParamSpec:
        """The parameter under its name or an alias; InvalidParameterError naming it when the method has none."""
        spec = self.param_index.get(name)
        if spec is None:
            known = ", ".join(p.name for p in self.params) or "none"
            raise InvalidParameterError(name, f"unknown parameter for {self.name} (known: {known})")
        return spec

    @property
    def requires_base(self) -> bool:
        return self.base == "required"

    def check_inputs(self, count: int, has_base: bool) -> None:
        """Raise InvalidParameterError (parameter ``models``) unless this many inputs, with or without a base, are
        what the method takes (mergekit's input contract; a base is not counted as such when ignored)."""
        if self.base == "required" and not has_base:
            raise InvalidParameterError("base_model", f"{self.name} needs a base model")
        has_base = has_base and self.base != "ignored"
        _check_count(self.name, "models", count, self.min_models, self.max_models)
        if self.min_non_base is not None or self.max_non_base is not None:
            _check_count(
                self.name, "models besides the base", count - int(has_base), self.min_non_base or 0, self.max_non_base
            )


def _check_count(method: str, what: str, count: int, minimum: int, maximum: int | None) -> None:
    if count < minimum or (maximum is not None and count > maximum):
        wanted = (
            f"exactly {minimum}"
            if minimum == maximum
            else f"at least {minimum}"
            if maximum is None
            else f"{minimum} to {maximum}"
        )
        raise InvalidParameterError("models", f"{method} takes {wanted} {what}, got {count}")


UNLIMITED = 1 << 30  # mergekit sets no upper bound; the service caps the model count itself


def param(
    name: str,
    type_: type,
    default: Any,
    scope: Scope = "global",
    minimum: float | None = None,
    maximum: float | None = None,
    description: str = "",
    required: bool = False,
) -> ParamSpec:
    return ParamSpec(name, type_, default, scope, minimum, maximum, description=description, required=required)


def required_weight(scope: Scope = "per_model") -> ParamSpec:
    return param("weight", float, None, scope, description="the model's weight (required)", required=True)


def check_required(
    spec: MethodSpec,
    global_params: Mapping[str, Any],
    model_params: Sequence[Mapping[str, Any]],
    base_index: int | None,
) -> None:
    """Raise InvalidParameterError for a required parameter left unset (canonical names expected): a global one
    anywhere, a per-model one for any model but the base (mergekit binds those to the other models only), an
    input one for any model. A value given globally counts for every model."""
    for param in spec.params:
        if not param.required or param.name in global_params:
            continue
        if param.scope == "global":
            raise InvalidParameterError(param.name, f"is required by {spec.name}")
        for index, params in enumerate(model_params):
            skip_base = param.scope == "per_model" and index == base_index
            if not skip_base and param.name not in params:
                raise InvalidParameterError(
                    param.name, f"is required by {spec.name} for every model (missing for model {index})"
                )
