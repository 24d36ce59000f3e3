"""Every merge method with its parameters, ranges and defaults as plain data (JSON-ready dicts and lists): what
``GET /methods`` and ``alloy methods`` show. Read from :data:`kernels.registry.METHODS`, the one source of truth."""

from __future__ import annotations

from typing import Any

from kernels.registry import METHODS
from kernels.specs import UNLIMITED, MethodSpec, ParamSpec

_TYPE_NAMES = {float: "float", int: "int", bool: "bool"}


def describe_param(param: ParamSpec) -> dict[str, Any]:
    return {
        "name": param.name,
        "type": _TYPE_NAMES[param.type],
        "scope": param.scope,
        "default": param.default,
        "required": param.required,
        "minimum": param.minimum,
        "maximum": param.maximum,
        "aliases": list(param.aliases),
        "description": param.description,
    }


def describe_method(spec: MethodSpec) -> dict[str, Any]:
    return {
        "name": spec.name,
        "family": spec.family,
        "description": spec.description,
        "reference": spec.reference,
        "base": spec.base,
        "requires_base": spec.requires_base,
        "random": spec.random,
        "min_models": spec.min_models,
        "max_models": None if spec.max_models >= UNLIMITED else spec.max_models,
        "min_non_base": spec.min_non_base,
        "max_non_base": spec.max_non_base,
        "parameters": [describe_param(p) for p in spec.params],
    }


def method_catalogue() -> list[dict[str, Any]]:
    """One entry per method, sorted by family then name."""
    return [describe_method(spec) for spec in sorted(METHODS.values(), key=lambda s: (s.family, s.name))]
