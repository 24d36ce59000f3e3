"""Passthrough (mergekit's passthrough): one input tensor copied through, multiplied by its optional ``scale``.
Layer stacking around it (franken merges) is name planning, in :mod:`kernels.franken`."""

from __future__ import annotations

import torch


def passthrough(tensor: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    out = tensor.to(torch.float32)
    if scale is None:
        return out.clone() if out is tensor else out
    return out * float(scale)


def merge(tensors, base_index, global_params, model_params, generator, owned=False):
    if len(tensors) != 1:
        raise ValueError(f"passthrough takes exactly one tensor, got {len(tensors)}")
    return passthrough(tensors[0], model_params[0].get("scale"))
