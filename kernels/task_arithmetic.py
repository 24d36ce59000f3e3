"""Task arithmetic: ``base + lambda * sum(w_i * (x_i - base))`` over the non-base models."""

from __future__ import annotations

from collections.abc import Sequence

import torch

NORMALIZE_EPS = 1e-8  # a weight sum this close to zero is not divided by (mergekit's rule)


def task_vector(
    model: torch.Tensor, base: torch.Tensor, owned: bool = False, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``model - base`` in ``dtype`` (float32 unless a kernel computes in a recipe's half dtype). With ``owned`` (the
    caller gives ``model`` up) a ``model`` of that dtype is turned into its task vector in place, which saves a
    tensor-sized buffer per model; the result is the same bits."""
    base = base.to(dtype)
    if owned and model.dtype == dtype:
        return model.sub_(base)
    return torch.sub(model.to(dtype), base)


def combine(
    base: torch.Tensor, weighted_deltas: Sequence[torch.Tensor], weights: Sequence[float], lam: float, normalize: bool
) -> torch.Tensor:
    """``base + lambda * sum(deltas) [/ sum(weights)]`` for deltas already multiplied by their weights."""
    mixed = weighted_deltas[0]
    for delta in weighted_deltas[1:]:
        mixed.add_(delta)
    if normalize:
        total = float(sum(weights))
        if abs(total) >= NORMALIZE_EPS:
            mixed.div_(total)
    if lam != 1:
        mixed.mul_(lam)
    return mixed.add_(base.to(torch.float32))


def task_arithmetic(
    base: torch.Tensor,
    models: Sequence[torch.Tensor],
    weights: Sequence[float],
    lam: float = 1.0,
    normalize: bool = False,
    owned: bool = False,
) -> torch.Tensor:
    if not models:
        return base.to(torch.float32).clone()
    deltas = [task_vector(m, base, owned).mul_(float(w)) for m, w in zip(models, weights)]
    return combine(base, deltas, weights, lam, normalize)


def split_base(tensors, base_index, model_params):
    """``(base, others, their parameter dicts)``."""
    others = [t for i, t in enumerate(tensors) if i != base_index]
    params = [p for i, p in enumerate(model_params) if i != base_index]
    return tensors[base_index], others, params


def merge(tensors, base_index, global_params, model_params, generator, owned=False):
    base, others, params = split_base(tensors, base_index, model_params)
    return task_arithmetic(
        base,
        others,
        [p["weight"] for p in params],
        float(global_params["lambda"]),
        bool(global_params["normalize"]),
        owned,
    )
