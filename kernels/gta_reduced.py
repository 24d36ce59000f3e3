"""Generalized task arithmetic computed in a reduced-precision dtype (bfloat16, float16), op for op as mergekit
0.1.5 computes it when a recipe says ``dtype: bfloat16`` (its inputs are cast to that dtype and every step of the
method stays in it): task vectors are rounded differences, the weights are rounded to the dtype (mergekit builds a
weight tensor of that dtype), the stacked sums (elected sign, agreeing deltas, divisor) are torch's reductions of
that dtype, the division, lambda and the final addition each round once.

Why a path of its own: the float32 path (:mod:`kernels.gta`) is tuned for speed and memory (in-place deltas,
chunked consensus) and must keep its bits; this one follows mergekit's order of operations literally, stacked
tensors included, so that a rounding step never differs. Both share the sparsifiers (:mod:`kernels.sparsify`),
whose top-k ranks the rounded magnitudes exactly (as float32, ties by position, :mod:`kernels.selection`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

NORMALIZE_EPS = 1e-8  # without consensus, a weight sum this close to zero is not divided by (mergekit's rule)
REDUCED_DTYPES = (torch.bfloat16, torch.float16)

# (delta owned, this model's resolved parameters, rescale, generator) -> the pruned delta
Pruner = Callable[[torch.Tensor, Mapping[str, Any], bool, torch.Generator | None], torch.Tensor]


def generalized_task_arithmetic_in(
    dtype: torch.dtype,
    base: torch.Tensor,
    models: Sequence[torch.Tensor],
    model_params: Sequence[Mapping[str, Any]],
    *,
    prune: Pruner | None,
    consensus: bool,
    normalize: bool,
    rescale: bool,
    lam: float,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """``base + lambda * combine(w_i * sparsify(x_i - base))`` with every step in ``dtype`` (see the module).
    Inputs are never modified; the result is a new tensor of ``dtype``."""
    if dtype not in REDUCED_DTYPES:
        raise ValueError(f"reduced-precision task arithmetic computes in bfloat16 or float16, not {dtype}")
    base = base.to(dtype)
    if not models:
        return base.clone()
    deltas = []
    for model, params in zip(models, model_params):
        delta = torch.sub(model.to(dtype), base)
        deltas.append(prune(delta, params, rescale, generator) if prune is not None else delta)
    stacked = torch.stack(deltas)
    del deltas
    weights = torch.tensor([float(p["weight"]) for p in model_params], dtype=dtype)
    weights = weights.reshape(-1, *([1] * base.dim()))
    stacked.mul_(weights)
    if consensus:
        agrees = agreement(stacked)
        mixed = (stacked * agrees).sum(dim=0)
        divisor = (weights * agrees).sum(dim=0)
        divisor[divisor == 0] = 1
    else:
        mixed = stacked.sum(dim=0)
        divisor = weights.sum(dim=0)
        divisor[divisor.abs() < NORMALIZE_EPS] = 1
    del stacked
    if normalize:
        mixed /= divisor
    if lam != 1:
        mixed *= lam
    return base + mixed


def agreement(stacked: torch.Tensor) -> torch.Tensor:
    """TIES sign consensus on stacked weighted deltas: each entry's sign is the sign of their sum (a sum of
    ``stacked``'s dtype; zero counts as +), and a delta agrees when its own sign is that one (zeros never do)."""
    majority = torch.where(stacked.sum(dim=0) >= 0, 1, -1).to(torch.int8)
    return stacked.sign().to(torch.int8) == majority
