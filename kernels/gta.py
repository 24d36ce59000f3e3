"""Generalized task arithmetic (mergekit's GeneralizedTaskArithmeticMerge): task vectors are sparsified, weighted,
optionally filtered by TIES sign consensus, combined, scaled by lambda and added to the base.

One kernel serves eight mergekit methods, which differ only in the sparsifier, the consensus step and defaults:
task_arithmetic (none, none), ties (magnitude, sum), dare_linear / dare_ties (bernoulli), breadcrumbs /
breadcrumbs_ties (magnitude outliers), della_linear / della (DELLA MagPrune).

Random sparsifiers draw from the per-tensor ``generator`` model by model, in the order of the non-base models,
each model's draws in row-major element order (see :func:`kernels.sparsify._draw_keep_`).
``int8_mask`` only changes the dtype of mergekit's sign mask (memory); it changes nothing here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from kernels import sparsify
from kernels.gta_reduced import generalized_task_arithmetic_in
from kernels.pieces import PIECE
from kernels.task_arithmetic import split_base, task_vector
from kernels.ties import finite_sign_consensus_, sign_consensus

CONSENSUS_CHUNK = PIECE  # elements per piece of the sign consensus (kernels.pieces)
NORMALIZE_EPS = 1e-8  # without consensus, a weight sum this close to zero is not divided by (mergekit's rule)

# (delta owned, this model's resolved parameters, rescale, generator) -> the pruned delta
Sparsifier = Callable[[torch.Tensor, Mapping[str, Any], bool, torch.Generator | None], torch.Tensor]


def _magnitude(delta, params, rescale, generator):
    return sparsify.magnitude_prune_(delta, float(params["density"]), rescale)


def _bernoulli(delta, params, rescale, generator):
    return sparsify.bernoulli_prune_(delta, float(params["density"]), _needs(generator), rescale)


def _outliers(delta, params, rescale, generator):
    return sparsify.outlier_prune_(delta, float(params["density"]), float(params["gamma"]), rescale)


def _della(delta, params, rescale, generator):
    return sparsify.della_prune_(delta, float(params["density"]), float(params["epsilon"]), _needs(generator), rescale)


def _needs(generator: torch.Generator | None) -> torch.Generator:
    if generator is None:
        raise ValueError("a random sparsifier needs the per-tensor seeded generator")
    return generator


SPARSIFIERS: dict[str, Sparsifier] = {
    "magnitude": _magnitude,
    "random": _bernoulli,
    "magnitude_outliers": _outliers,
    "della_magprune": _della,
}


def weight_sum(weights: Sequence[float]) -> float:
    """The weights summed in float32, as mergekit sums its float32 weight tensor."""
    return float(torch.tensor([float(w) for w in weights], dtype=torch.float32).sum())


def generalized_task_arithmetic(
    base: torch.Tensor,
    models: Sequence[torch.Tensor],
    model_params: Sequence[Mapping[str, Any]],
    *,
    sparsifier: str | None,
    consensus: bool,
    normalize: bool,
    rescale: bool,
    lam: float,
    generator: torch.Generator | None = None,
    owned: bool = False,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``base + lambda * combine(w_i * sparsify(x_i - base))``; each of ``model_params`` holds ``weight`` and what
    the sparsifier reads (``density``, ``gamma``, ``epsilon``). No models: the base itself (as float32).
    ``dtype`` is the compute dtype: float32 here; bfloat16 or float16 in :mod:`kernels.gta_reduced`, op for op as
    mergekit computes in a recipe's dtype (the result is then of that dtype)."""
    prune = SPARSIFIERS[sparsifier] if sparsifier else None
    if dtype != torch.float32:
        return generalized_task_arithmetic_in(
            dtype,
            base,
            models,
            model_params,
            prune=prune,
            consensus=consensus,
            normalize=normalize,
            rescale=rescale,
            lam=lam,
            generator=generator,
        )
    if not models:
        return base.to(torch.float32).clone()
    weights = [float(p["weight"]) for p in model_params]
    deltas: list[torch.Tensor] = []  # consensus needs every delta at once; a plain sum needs one at a time
    mixed: torch.Tensor | None = None
    for model, params, weight in zip(models, model_params, weights):
        delta = task_vector(model, base, owned)
        if prune is not None:
            delta = prune(delta, params, rescale, generator)
        if weight != 1:  # x * 1 is x (the delta is a result of arithmetic, so no signalling NaN): skip the pass
            delta.mul_(weight)
        if consensus:
            deltas.append(delta)
        elif mixed is None:
            mixed = delta
        else:
            mixed.add_(delta)
            del delta
    if consensus:
        return _chunked_consensus(base, deltas, weights, lam, normalize)
    assert mixed is not None  # there is a model (checked above), so the loop set it
    if normalize:
        total = weight_sum(weights)
        mixed.div_(total if abs(total) >= NORMALIZE_EPS else 1.0)
    if lam != 1:
        mixed.mul_(lam)
    return mixed.add_(base.to(torch.float32))


def _chunked_consensus(
    base: torch.Tensor, deltas: list[torch.Tensor], weights: Sequence[float], lam: float, normalize: bool
) -> torch.Tensor:
    """:func:`kernels.ties.sign_consensus` applied piece by piece (it is elementwise, so the bits are the same):
    its temporaries (elected signs, agreement masks, divisor) stay piece-sized and in cache instead of several
    tensor-sized allocations; the result is written into the first delta's buffer."""
    flat_base = base.reshape(-1)
    flats = [d.view(-1) for d in deltas if d.is_contiguous()]
    if len(flats) != len(deltas) or flat_base.numel() != flats[0].numel():
        return sign_consensus(base, deltas, weights, lam, normalize)
    for start in range(0, flat_base.numel(), CONSENSUS_CHUNK):
        piece = slice(start, start + CONSENSUS_CHUNK)
        pieces = [f[piece] for f in flats]
        if finite_sign_consensus_(flat_base[piece], pieces, weights, lam, normalize) is None:
            sign_consensus(flat_base[piece], pieces, weights, lam, normalize)
    return deltas[0]


def kernel(sparsifier: str | None, consensus: bool):
    """The registry's ``merge(tensors, base_index, global_params, model_params, generator, owned, dtype)`` for one
    sparsifier/consensus combination."""

    def merge(tensors, base_index, global_params, model_params, generator, owned=False, dtype=torch.float32):
        base, others, params = split_base(tensors, base_index, model_params)
        return generalized_task_arithmetic(
            base,
            others,
            params,
            sparsifier=sparsifier,
            consensus=consensus,
            normalize=bool(global_params["normalize"]),
            rescale=bool(global_params["rescale"]),
            lam=float(global_params["lambda"]),
            generator=generator,
            owned=owned,
            dtype=dtype,
        )

    return merge
