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


def merge(tensors, base_index, global_params, model_params, generator, owned=False):
    others = [t for i, t in enumerate(tensors) if i != base_index]
    return sce(tensors[base_index], others, float(global_params["select_topk"]), owned)
