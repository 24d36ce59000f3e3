"""Parameter values and their resolution for one tensor.

A parameter value takes one of three forms (the mergekit forms):

* a scalar: ``0.5`` or ``true``;
* a gradient: ``[0.0, 0.5, 1.0]``, interpolated piecewise-linearly over depth ``t`` in [0, 1];
* a filter list: ``[{"filter": "self_attn", "value": 0.3}, {"value": 0.7}]``: the first entry whose ``filter``
  is a substring of the tensor name (or that has no filter, or ``"*"``) gives the value, itself a scalar or a
  gradient.

Depth follows mergekit: layer ``i`` of ``L`` has ``t = i / (L - 1)`` (``t = 1`` when ``L == 1``); tensors outside
the layer stack (embeddings, final norm, LM head) have ``t = 0``.
"""

from __future__ import annotations

import re
from typing import Any

Scalar = float | int | bool

_LAYER_INDEX = re.compile(r"(?:^|\.)(?:layers|layer|h|blocks|block)\.(\d+)\.")


def layer_index(tensor_name: str) -> int | None:
    """The transformer-block index in a Hugging Face tensor name (``model.layers.3.mlp...`` -> 3), or None."""
    match = _LAYER_INDEX.search(tensor_name)
    return int(match.group(1)) if match else None


def is_scalar(value: Any) -> bool:
    return isinstance(value, (bool, int, float))


def is_gradient(value: Any) -> bool:
    return isinstance(value, list) and len(value) > 0 and all(is_scalar(v) and not isinstance(v, bool) for v in value)


def is_filter_list(value: Any) -> bool:
    return isinstance(value, list) and len(value) > 0 and all(isinstance(v, dict) and "value" in v for v in value)


def interpolate(points: list[float], t: float) -> float:
    """Piecewise-linear interpolation of evenly spaced ``points`` at ``t`` in [0, 1]."""
    if len(points) == 1:
        return float(points[0])
    scaled = min(max(t, 0.0), 1.0) * (len(points) - 1)
    low = int(scaled)
    high = min(len(points) - 1, low + 1)
    frac = scaled - low
    return (1 - frac) * float(points[low]) + frac * float(points[high])


def filter_matches(filter_: str | None, tensor_name: str) -> bool:
    return filter_ is None or filter_ == "*" or filter_ in tensor_name


def resolve_value(value: Any, tensor_name: str, t: float) -> Scalar | None:
    """The scalar a parameter value takes for one tensor at depth ``t``; None when no filter matches."""
    if is_scalar(value):
        return value
    if is_gradient(value):
        return interpolate(value, t)
    if is_filter_list(value):
        for entry in value:
            if filter_matches(entry.get("filter"), tensor_name):
                return resolve_value(entry["value"], tensor_name, t)
        return None
    raise ValueError(f"not a parameter value: {value!r}")


def scalar_points(value: Any) -> list[Scalar]:
    """Every scalar a value can produce (gradient points, filter values): what range checks look at."""
    if is_scalar(value):
        return [value]
    if is_gradient(value):
        return list(value)
    if is_filter_list(value):
        return [point for entry in value for point in scalar_points(entry["value"])]
    raise ValueError(f"not a parameter value: {value!r}")
