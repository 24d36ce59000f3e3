"""SCE (mergekit's sce): Select, Calculate, Erase.

Select: keep the ``select_topk`` fraction of entries where the task vectors vary most across models (variance over
models, exact top-k with ties kept by position, of ``int(nonzero * select_topk)`` entries). Calculate: each model's
weight is its mean squared (selected) task vector over the sum of those. Erase: TIES sign consensus on the sum of
the task vectors; the merged change is the weighted mean of the agreeing changes. ``int8_mask`` only changes the
dtype of mergekit's masks (memory); it changes nothing here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from kernels import pieces, selection
from kernels.gta_reduced import agreement
from kernels.reductions import stable_dot
from kernels.sparsify import top_k_mask
from kernels.task_arithmetic import task_vector
from kernels.ties import elected_side

WEIGHT_SUM_EPS = 1e-6
DIVISOR_FLOOR = 1e-6


def variance(deltas: Sequence[torch.Tensor]) -> torch.Tensor:
    """The population variance across models, entry by entry (elementwise: the same bits whole or by pieces)."""
    mean = deltas[0].clone()
    for delta in deltas[1:]:
        mean.add_(delta)
    mean.div_(len(deltas))
    spread = torch.zeros_like(mean)
    for delta in deltas:
        spread.add_(torch.sub(delta, mean).square_())
    return spread.div_(len(deltas))


def variance_mask(deltas: Sequence[torch.Tensor], select_topk: float) -> torch.Tensor:
    """Boolean mask of the entries with the largest variance across models (population variance)."""
    if select_topk <= 0:
        return torch.zeros_like(deltas[0], dtype=torch.bool)
    values = variance(deltas)
    k = int(int(torch.count_nonzero(values)) * select_topk)
    return top_k_mask(values.view(-1), k).view_as(values)


def sce_weights(deltas: Sequence[torch.Tensor]) -> list[float]:
    squares = [float(stable_dot(d, d)) / max(d.numel(), 1) for d in deltas]
    total = sum(squares)
    if abs(total) < WEIGHT_SUM_EPS:
        return [1.0 / len(deltas)] * len(deltas)
    return [s / total for s in squares]


def erase(deltas: Sequence[torch.Tensor], weights: Sequence[float], base: torch.Tensor) -> torch.Tensor:
    """Erase and merge (elementwise): the sign of the summed task vectors is elected; each entry is the weighted
    mean of the agreeing changes, plus the base."""
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
        mixed.add_(delta * agrees, alpha=weight)
    return mixed.div_(divisor.clamp_(min=DIVISOR_FLOOR)).add_(base.to(torch.float32))


def finite_erase(deltas: Sequence[torch.Tensor], weights: Sequence[float], base: torch.Tensor) -> torch.Tensor | None:
    """:func:`erase` on a cache-sized piece in float ops only, bit for bit the same when the elected sums are finite;
    None (nothing computed) otherwise, for the caller to take :func:`erase`. WHY: its bool comparisons, ``where``
    and bool operands were 4.6 of SCE's 8 ns per input element (the same cost TIES's consensus had). The identities
    are :func:`kernels.ties.finite_sign_consensus_`'s: the elected side is ``copysign(1, sum)`` (a -0 sum needs every
    delta -0, which agrees with neither side), ``agrees`` as a float is ``sign(max(delta * side, 0))`` and
    ``delta * agrees`` is ``copysign(max(delta * side, 0), delta)``; each is added with the same ``alpha`` op as
    in :func:`erase`, so every sum rounds as there."""
    side = elected_side(deltas)
    if side is None:  # a sum not finite: the general path is exact
        return None
    divisor = torch.zeros_like(side)
    mixed = torch.zeros_like(side)
    kept = torch.empty_like(side)
    for delta, weight in zip(deltas, weights):
        torch.mul(delta, side, out=kept).clamp_min_(0.0)
        divisor.add_(torch.sign(kept), alpha=weight)
        mixed.add_(torch.copysign(kept, delta, out=kept), alpha=weight)
    return mixed.div_(divisor.clamp_(min=DIVISOR_FLOOR)).add_(base.to(torch.float32))


def sce(
    base: torch.Tensor, models: Sequence[torch.Tensor], select_topk: float = 1.0, owned: bool = False
) -> torch.Tensor:
    if not models:
        return base.to(torch.float32).clone()
    deltas = [task_vector(m, base, owned) for m in models]
    if all(d.device.type == "cpu" and d.is_contiguous() and d.shape == base.shape for d in deltas):
        return sce_by_pieces(base, deltas, select_topk)
    return sce_whole(base, deltas, select_topk)


def sce_whole(base: torch.Tensor, deltas: list[torch.Tensor], select_topk: float) -> torch.Tensor:
    """SCE on whole tensors (any device; the deltas are the caller's and are masked in place)."""
    if select_topk < 1:
        mask = variance_mask(deltas, select_topk)
        for delta in deltas:
            delta.mul_(mask)
        del mask
    return erase(deltas, sce_weights(deltas), base)


def sce_by_pieces(base: torch.Tensor, deltas: list[torch.Tensor], select_topk: float) -> torch.Tensor:
    """:func:`sce_whole` on contiguous CPU deltas, each elementwise step a piece at a time (the same ops on each
    entry, so the same bits), the result written into the first delta's buffer. WHY: on whole tensors the mean,
    the variance, a difference, the mask, the elected sum, the divisor and the mixed sum are alive together, 4
    tensor-sized temporaries beside the inputs (SCE peaked at 0.51x mergekit's memory where TIES peaks at 0.38x).
    Only the variance stays whole (its top-k is a whole-tensor selection), then made the keep factors in place."""
    flats, numel = [d.view(-1) for d in deltas], deltas[0].numel()
    if select_topk < 1:
        values = torch.empty(numel, dtype=torch.float32)
        for piece in _pieces(numel):
            values[piece] = variance([f[piece] for f in flats])
        k = int(int(torch.count_nonzero(values)) * select_topk) if select_topk > 0 else 0
        if k < numel:  # else every entry is kept (x * True is x)
            keep = _keep_factors_(values, k)  # float factors; where a variance is not finite, the bool mask
            if keep is None:
                keep = (
                    selection.cut_mask(values, selection.top_cut(values, k))
                    if k
                    else torch.zeros(numel, dtype=torch.bool)
                )
            for piece in _pieces(numel):
                for flat in flats:
                    flat[piece].mul_(keep[piece])
        del values
    weights = sce_weights(deltas)
    flat_base = base.reshape(-1)
    for piece in _pieces(numel):
        pieces = [f[piece] for f in flats]
        merged = finite_erase(pieces, weights, flat_base[piece])
        flats[0][piece] = merged if merged is not None else erase(pieces, weights, flat_base[piece])
    return deltas[0]


PIECE = pieces.PIECE  # elements per step of sce_by_pieces: its temporaries stay in cache


def _keep_factors_(values: torch.Tensor, k: int) -> torch.Tensor | None:
    """The flat variances ``values`` (the caller's scratch) made, in place, each entry's factor: 1.0 among the
    ``k`` (< numel) largest, +0 elsewhere, what multiplying by the bool top-k mask multiplies by; None (values
    untouched) when a variance is not finite: sign(NaN) is NaN, where the mask's True is 1. WHY: a float times a
    bool mask was 8x slower than float times float (0.81 against 0.10 ns an entry), once for every model. Kept
    variances are positive (k counts the nonzero ones), so their sign is 1."""
    if not math.isfinite(float(values.sum())):  # a sum of non-negatives: not finite iff an entry is (or overflow)
        return None
    if k > 0:
        selection.keep_cut_(values, selection.top_cut(values, k))
    else:
        values.zero_()
    return values.sign_()


def _pieces(numel: int):
    return (slice(start, start + PIECE) for start in range(0, numel, PIECE))


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
