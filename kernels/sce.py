"""SCE (mergekit's sce): Select, Calculate, Erase.

Select: keep the ``select_topk`` fraction of entries where the task vectors vary most across models (variance over
models, exact top-k with ties kept by position, of ``int(nonzero * select_topk)`` entries). Calculate: each model's
weight is its mean squared (selected) task vector over the sum of those. Erase: TIES sign consensus on the sum of
the task vectors; the merged change is the weighted mean of the agreeing changes. ``int8_mask`` only changes the
dtype of mergekit's masks (memory); it changes nothing here.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kernels.gta_reduced import agreement
from kernels.reductions import stable_dot
from kernels.sparsify import top_k_mask
from kernels.task_arithmetic import task_vector

WEIGHT_SUM_EPS = 1e-6
DIVISOR_FLOOR = 1e-6


def variance_mask(deltas: Sequence[torch.Tensor], select_topk: float) -> torch.Tensor:
    """Boolean mask of the entries with the largest variance across models (population variance)."""
    if select_topk <= 0:
        return torch.zeros_like(deltas[0], dtype=torch.bool)
    mean = deltas[0].clone()
    for delta in deltas[1:]:
        mean.add_(delta)
    mean.div_(len(deltas))
    variance = torch.zeros_like(mean)
    for delta in deltas:
        variance.add_(torch.sub(delta, mean).square_())
    del mean
    variance.div_(len(deltas))
    k = int(int(torch.count_nonzero(variance)) * select_topk)
    return top_k_mask(variance.view(-1), k).view_as(variance)


def sce_weights(deltas: Sequence[torch.Tensor]) -> list[float]:
    squares = [float(stable_dot(d, d)) / max(d.numel(), 1) for d in deltas]
    total = sum(squares)
    if abs(total) < WEIGHT_SUM_EPS:
        return [1.0 / len(deltas)] * len(deltas)
    return [s / total for s in squares]


def sce(
    base: torch.Tensor, models: Sequence[torch.Tensor], select_topk: float = 1.0, owned: bool = False
) -> torch.Tensor:
    if not models:
        return base.to(torch.float32).clone()
    deltas = [task_vector(m, base, owned) for m in models]
    if select_topk < 1:
        mask = variance_mask(deltas, select_topk)
        for delta in deltas:
            delta.mul_(mask)
        del mask
    weights = sce_weights(deltas)
    elected = deltas[0].clone()
    for delta in deltas[1:]:
        elected.add_(delta)
    positive = elected >= 0
    del elected
    divisor = torch.zeros_like(deltas[0])
    mixed = torch.zeros_like(deltas[0])
    for delta, weight in zip(deltas, weights):
        agrees = torch.where(positive, delta > 0, delta < 0)
        divisor.add_(agrees, alpha=weight)
        mixed.add_(delta.mul_(agrees), alpha=weight)
    return mixed.div_(divisor.clamp_(min=DIVISOR_FLOOR)).add_(base.to(torch.float32))


def sce_in(dtype: torch.dtype, base: torch.Tensor, models: Sequence[torch.Tensor], select_topk: float = 1.0):
    """SCE with every step in a recipe's half ``dtype``, in mergekit's order of operations (stacked task vectors,
    their variance, weights and sums as reductions of that dtype): what mergekit computes for ``dtype: bfloat16``.
    The top-k of the variances ranks the rounded values exactly, ties by position (mergekit's topk: unspecified)."""
    base = base.to(dtype)
    if not models:
        return base.clone()
    stacked = torch.stack([m.to(dtype) - base for m in models])
    if select_topk < 1:
        mask = torch.zeros(stacked.shape[1:], dtype=torch.bool)
        if select_topk > 0:
            variance = torch.var(stacked, dim=0, unbiased=False)
            k = int(int(torch.count_nonzero(variance)) * select_topk)
            mask = top_k_mask(variance.view(-1), k).view_as(variance)
        stacked = stacked * mask.unsqueeze(0)
    agrees = agreement(stacked)
    weights = stacked.square().reshape(len(models), -1).mean(dim=1)
    total = torch.sum(weights).item()
    weights = torch.ones_like(weights) / len(models) if abs(total) < WEIGHT_SUM_EPS else weights / total
    weights = weights.reshape(-1, *([1] * base.dim())) * agrees
    merged = (stacked * weights).sum(dim=0)
    return base + merged / torch.sum(weights, dim=0).clamp(min=DIVISOR_FLOOR)


def merge(tensors, base_index, global_params, model_params, generator, owned=False, dtype=torch.float32):
    others = [t for i, t in enumerate(tensors) if i != base_index]
    if dtype != torch.float32:
        return sce_in(dtype, tensors[base_index], others, float(global_params["select_topk"]))
    return sce(tensors[base_index], others, float(global_params["select_topk"]), owned)
