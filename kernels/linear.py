"""Weighted average of the models' tensors: the baseline strategy."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kernels.errors import InvalidParameterError


def linear(tensors: Sequence[torch.Tensor], weights: Sequence[float], normalize: bool = True) -> torch.Tensor:
    """``sum(w_i * x_i)``, divided by ``sum(w_i)`` when ``normalize``; float32 result."""
    out = tensors[0].to(torch.float32) * float(weights[0])
    for tensor, weight in zip(tensors[1:], weights[1:]):
        out.add_(tensor.to(torch.float32), alpha=float(weight))
    if normalize:
        total = float(sum(weights))
        if total == 0:
            raise InvalidParameterError("weight", "weights sum to zero, so they cannot be normalized")
        out.div_(total)
    return out


def merge(tensors, base_index, global_params, model_params, generator, owned=False):
    return linear(tensors, [p["weight"] for p in model_params], bool(global_params["normalize"]))
