"""Merge methods as the merge engine sees them: mergekit's method names (the kernels' ``METHODS``), each a variant
of one of the five HTTP strategy families, and how an Alloy-native recipe picks one."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from alloy.errors import AlloyError, ErrorCode
from kernels.errors import UnknownStrategyError
from kernels.params import scalar_points
from kernels.registry import get_method as kernel_method
from kernels.specs import MethodSpec, ParamSpec

# The HTTP ``strategy`` field takes exactly these (service spec); every method is a variant of one of them.
FAMILIES = ("slerp", "ties", "dare", "task_arithmetic", "franken_merge")
# The variant a family means when the request names none.
DEFAULT_VARIANT = {
    "slerp": "slerp",
    "ties": "ties",
    "dare": "dare_linear",
    "task_arithmetic": "task_arithmetic",
    "franken_merge": "passthrough",
}


def is_shared(param: ParamSpec) -> bool:
    """One value per tensor (mergekit's SHARED scope) rather than one per input model."""
    return param.scope == "global"


def is_required(param: ParamSpec) -> bool:
    """mergekit refuses a merge that leaves such a parameter unset (for a non-base input, unless scope input)."""
    return bool(param.required)


def uses_base(method: MethodSpec) -> bool:
    """Whether the kernel is told which input is the base (mergekit's base policy is not "ignored")."""
    return method.base != "ignored"


def get_method(name: str) -> MethodSpec:
    """The method spec for a mergekit method name; INVALID_STRATEGY naming it when the kernels have none."""
    try:
        return kernel_method(name)
    except UnknownStrategyError as exc:
        raise AlloyError(
            ErrorCode.INVALID_STRATEGY,
            f"merge method {name!r} is not available; known: {', '.join(exc.known)}",
            {"strategy": name, "known": exc.known},
        ) from None


def check_family(strategy: str) -> None:
    if strategy not in FAMILIES:
        raise AlloyError(
            ErrorCode.INVALID_STRATEGY,
            f"unknown strategy {strategy!r}; strategy is one of {', '.join(FAMILIES)} "
            "(a mergekit method name goes in 'variant')",
            {"strategy": strategy, "known": list(FAMILIES)},
        )


def resolve_variant(strategy: str, variant: str | None, parameters: Mapping[str, Any]) -> MethodSpec:
    """The method of an Alloy-native recipe: ``variant`` when given (it must be of the ``strategy`` family), else
    the family's default, where the spec's documented spellings pick a variant: ties with ``epsilon > 0`` is
    ``della`` (DELLA's MagPrune), dare with ``consensus: true`` is ``dare_ties``."""
    check_family(strategy)
    if variant is None:
        variant = DEFAULT_VARIANT[strategy]
        if strategy == "ties" and _positive(parameters.get("epsilon")):
            variant = "della"
        if strategy == "dare" and parameters.get("consensus") is True:
            variant = "dare_ties"
    method = get_method(variant)
    if method.family != strategy:
        raise AlloyError(
            ErrorCode.INVALID_STRATEGY,
            f"variant {variant!r} belongs to the {method.family} family, not {strategy}",
            {"field": "variant", "strategy": strategy, "variant": variant},
        )
    return method


def _positive(value: Any) -> bool:
    if value is None:
        return False
    try:
        return any(not isinstance(p, bool) and p > 0 for p in scalar_points(value))
    except ValueError:
        return False


def method_catalogue() -> list[dict[str, Any]]:
    """Every method with its family, inputs and parameters (scope, type, range, default) as plain data: what
    ``GET /methods`` and ``alloy methods`` show (the kernels' catalogue, read from ``METHODS``)."""
    from kernels.catalogue import method_catalogue as kernel_catalogue

    return kernel_catalogue()
