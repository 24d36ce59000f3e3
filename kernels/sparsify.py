"""Task-vector sparsification: exact top-k magnitude trim, rank-based stochastic pruning and random drop.

Top-k uses ``torch.kthvalue`` (a selection, linear time) rather than a sort; ties at the threshold are broken by
position so the kept count is exactly ``k = max(1, int(density * n))`` as in mergekit.
All functions return a new float32 tensor or modify a tensor the caller owns (named ``owned``).
"""

from __future__ import annotations

import torch

from kernels.errors import InvalidParameterError

RANDOM_CHUNK = 1 << 24  # elements of uniform noise drawn at a time; fixed so the draw sequence never changes


def keep_count(density: float, numel: int) -> int:
    return max(1, int(density * numel))


def top_magnitude_mask(x: torch.Tensor, density: float) -> torch.Tensor | None:
    """Boolean mask of the ``density`` fraction of largest-magnitude entries; None means keep everything."""
    numel = x.numel()
    if density >= 1:
        return None
    if density <= 0 or numel == 0:
        return torch.zeros_like(x, dtype=torch.bool)
    k = keep_count(density, numel)
    if k >= numel:
        return None
    magnitude = x.abs().reshape(-1)
    threshold = torch.kthvalue(magnitude, numel - k + 1).values
    mask = magnitude > threshold
    missing = k - int(mask.sum())
    if missing > 0:  # entries equal to the threshold: keep the first ones by position
        tied = torch.nonzero(magnitude == threshold).squeeze(1)[:missing]
        mask[tied] = True
    return mask.view_as(x)


def magnitude_trim_(owned: torch.Tensor, density: float) -> torch.Tensor:
    """TIES trim: zero all but the top ``density`` fraction by magnitude (in place)."""
    mask = top_magnitude_mask(owned, density)
    if mask is not None:
        owned.mul_(mask)
    return owned


def uniform(numel: int, generator: torch.Generator) -> torch.Tensor:
    """``numel`` uniform [0, 1) draws on the CPU, drawn in fixed chunks so the sequence is reproducible."""
    return torch.cat([torch.rand(min(RANDOM_CHUNK, numel - start), generator=generator)
                      for start in range(0, numel, RANDOM_CHUNK)]) if numel else torch.empty(0)


def ranked_stochastic_prune_(owned: torch.Tensor, density: float, epsilon: float, generator: torch.Generator) -> torch.Tensor:
    """Magnitude-ranked stochastic pruning (DELLA's MagPrune): entry of magnitude rank r (0 = smallest) of n is kept
    with probability ``p = density - epsilon + 2 * epsilon * r / (n - 1)`` and survivors are divided by ``p`` so the
    expectation of every entry is unchanged."""
    if density - epsilon < 0 or density + epsilon > 1:
        raise InvalidParameterError("epsilon", f"density ± epsilon must lie in [0, 1] (density={density}, epsilon={epsilon})")
    numel = owned.numel()
    if numel == 0:
        return owned
    flat = owned.view(-1)
    order = torch.argsort(flat.abs().cpu(), stable=True)
    ranks = torch.empty(numel, dtype=torch.float32)
    ranks[order] = torch.arange(numel, dtype=torch.float32)
    probability = ranks.mul_(2 * epsilon / max(numel - 1, 1)).add_(density - epsilon)
    keep = uniform(numel, generator) < probability
    scale = torch.where(keep, 1.0 / probability.clamp_min(1e-12), 0.0).to(owned.device)
    flat.mul_(scale)
    return owned


def random_drop_(owned: torch.Tensor, drop_rate: float, rescale: bool, generator: torch.Generator) -> torch.Tensor:
    """DARE: drop each entry with probability ``drop_rate``; survivors times ``1 / (1 - drop_rate)`` when
    ``rescale``. ``drop_rate == 0`` is the identity and draws nothing."""
    if drop_rate <= 0:
        return owned
    flat = owned.view(-1)
    for start in range(0, flat.numel(), RANDOM_CHUNK):
        piece = flat[start : start + RANDOM_CHUNK]
        keep = torch.rand(piece.numel(), generator=generator) >= drop_rate
        piece.mul_(keep.to(owned.device))
    if rescale and drop_rate < 1:
        owned.mul_(1.0 / (1.0 - drop_rate))
    return owned
