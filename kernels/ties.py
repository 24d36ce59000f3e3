"""TIES-merging: trim each task vector, elect a sign per entry, average the entries that agree with it."""

from __future__ import annotations

import math
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


def elected_side(deltas: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """``copysign(1, sum of the deltas)`` entry by entry (a new tensor; the sum taken in the deltas' order), or None
    when a sum is not finite (also when a large finite sum overflows): the float-only paths' elected sign."""
    elected = torch.add(deltas[0], deltas[1]) if len(deltas) > 1 else deltas[0].clone()
    for delta in deltas[2:]:
        elected.add_(delta)
    if not math.isfinite(float(elected.sum())):
        return None
    return torch.copysign(torch.ones_like(elected), elected, out=elected)


def finite_sign_consensus_(
    base: torch.Tensor,
    weighted_deltas: Sequence[torch.Tensor],
    weights: Sequence[float],
    lam: float,
    normalize: bool,
) -> torch.Tensor | None:
    """:func:`sign_consensus` on a cache-sized piece, in float ops only, bit for bit the same for finite inputs;
    None (nothing modified) when an elected sum is not finite, for the caller to take :func:`sign_consensus`.

    WHY: torch's comparisons and ``where`` that produce bool tensors, and float ops mixing in a bool operand, were
    measured 5-30x slower per element than float ops on the CPU. Identities used (all exact for finite values):
    the elected sign is ``copysign(1, sum)`` (a sum of -0 needs every delta -0, which agrees with neither sign);
    ``delta * agrees`` is ``copysign(max(delta * sign, 0), delta)`` (kept: ``|delta|`` with delta's sign; dropped:
    zero with delta's sign, as ``delta * 0``); ``agrees`` as a float is ``sign(max(delta * sign, 0))``, whose zero
    may be -0 (it only adds zero to the divisor, whose zeros are replaced by 1 whatever their sign)."""
    side = elected_side(weighted_deltas)
    if side is None:
        return None
    divisor = torch.zeros_like(side) if normalize else None
    kept = torch.empty_like(side)
    for delta, weight in zip(weighted_deltas, weights):
        torch.mul(delta, side, out=kept).clamp_min_(0.0)
        if divisor is not None:
            divisor.add_(torch.sign(kept), alpha=float(weight))
        torch.copysign(kept, delta, out=delta)
    del kept, side
    mixed = weighted_deltas[0]
    for delta in weighted_deltas[1:]:
        mixed.add_(delta)
    if divisor is not None:
        # zeros become 1, other values stay (they are sums of finite weights): + (1 - sign(divisor)^2)
        zero = torch.sign(divisor)
        divisor.add_(zero.mul_(zero).neg_().add_(1.0))
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
