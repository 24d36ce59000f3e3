"""TIES-merging: trim each task vector, elect a sign per entry, average the entries that agree with it."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kernels.sparsify import magnitude_trim_, ranked_stochastic_prune_
from kernels.task_arithmetic import split_base, task_vector


def sign_consensus(
    base: torch.Tensor, weighted_deltas: Sequence[torch.Tensor], weights: Sequence[float], lam: float, normalize: bool
) -> torch.Tensor:
    """Elect each entry's sign from the sum of the weighted deltas (ties go to +), keep only the deltas of that
    sign (zeros never vote), and add their sum (divided by the sum of the weights that voted, when ``normalize``)
    times ``lam`` to the base. Consumes ``weighted_deltas``."""
    elected = weighted_deltas[0].clone()
    for delta in weighted_deltas[1:]:
        elected.add_(delta)
    positive = elected >= 0
    del elected
    divisor = torch.zeros_like(weighted_deltas[0]) if normalize else None
    for delta, weight in zip(weighted_deltas, weights):
        agrees = torch.where(positive, delta > 0, delta < 0)
        delta.mul_(agrees)
        if divisor is not None:
            divisor.add_(agrees, alpha=float(weight))
    del positive
    mixed = weighted_deltas[0]  # accumulate in the first delta's buffer: no extra tensor
    for delta in weighted_deltas[1:]:
        mixed.add_(delta)
    if divisor is not None:
        divisor.masked_fill_(divisor == 0, 1.0)
        mixed.div_(divisor)
    if lam != 1:
        mixed.mul_(lam)
    return mixed.add_(base.to(torch.float32))


def ties(
    base: torch.Tensor,
    models: Sequence[torch.Tensor],
    weights: Sequence[float],
    densities: Sequence[float],
    lam: float = 1.0,
    normalize: bool = True,
    epsilons: Sequence[float] | None = None,
    generator: torch.Generator | None = None,
    owned: bool = False,
) -> torch.Tensor:
    """TIES with per-model density; ``epsilon > 0`` replaces the trim by magnitude-ranked stochastic pruning."""
    if not models:
        return base.to(torch.float32).clone()
    epsilons = epsilons or [0.0] * len(models)
    deltas = []
    for model, weight, density, epsilon in zip(models, weights, densities, epsilons):
        delta = task_vector(model, base, owned)
        if epsilon > 0 and 0 < density < 1:
            if generator is None:
                raise ValueError("stochastic pruning (epsilon > 0) needs a seeded generator")
            ranked_stochastic_prune_(delta, density, epsilon, generator)
        else:
            magnitude_trim_(delta, density)
        deltas.append(delta.mul_(float(weight)))
    return sign_consensus(base, deltas, weights, lam, normalize)


def merge(tensors, base_index, global_params, model_params, generator, owned=False):
    base, others, params = split_base(tensors, base_index, model_params)
    return ties(
        base,
        others,
        [p["weight"] for p in params],
        [p["density"] for p in params],
        float(global_params["lambda"]),
        bool(global_params["normalize"]),
        [p["epsilon"] for p in params],
        generator,
        owned,
    )
