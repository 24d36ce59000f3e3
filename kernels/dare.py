"""DARE: randomly drop task-vector entries, rescale the survivors, then task arithmetic or TIES sign consensus."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kernels.sparsify import random_drop_
from kernels.task_arithmetic import combine, split_base, task_vector
from kernels.ties import sign_consensus


def dare(
    base: torch.Tensor,
    models: Sequence[torch.Tensor],
    weights: Sequence[float],
    drop_rates: Sequence[float],
    generator: torch.Generator,
    rescale: bool = True,
    consensus: bool = False,
    lam: float = 1.0,
    normalize: bool = False,
    owned: bool = False,
) -> torch.Tensor:
    """Models draw their masks in order from ``generator`` (seeded per tensor by the caller)."""
    if not models:
        return base.to(torch.float32).clone()
    deltas = [
        random_drop_(task_vector(m, base, owned), float(p), rescale, generator).mul_(float(w))
        for m, w, p in zip(models, weights, drop_rates)
    ]
    if consensus:
        return sign_consensus(base, deltas, weights, lam, normalize)
    return combine(base, deltas, weights, lam, normalize)


def merge(tensors, base_index, global_params, model_params, generator, owned=False):
    base, others, params = split_base(tensors, base_index, model_params)
    return dare(
        base,
        others,
        [p["weight"] for p in params],
        [p["drop_rate"] for p in params],
        generator,
        bool(global_params["rescale"]),
        bool(global_params["consensus"]),
        float(global_params["lambda"]),
        bool(global_params["normalize"]),
        owned,
    )
