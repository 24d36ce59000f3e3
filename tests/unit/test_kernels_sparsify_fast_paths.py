"""The in-place float paths of kernels.sparsify give the bits (signed zeros and NaN included) of the mask-based
reference: Model Breadcrumbs' rank band (keep below one cut, drop the top cut) and selection.drop_cut_."""

from __future__ import annotations

import pytest
import torch

from kernels import selection
from kernels.sparsify import _rank_band_mask, outlier_prune_

SPECIALS = [0.0, -0.0, 1e-45, -1e-45, 3e-39, 1.0, -1.0, 2.0, -2.0, 3e38, -3e38]


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int32)


def heavy_ties(n: int, seed: int, extra: tuple[float, ...] = ()) -> torch.Tensor:
    values = torch.tensor(SPECIALS + list(extra), dtype=torch.float32)
    return values[torch.randint(len(values), (n,), generator=torch.Generator().manual_seed(seed))]


def randn(n: int, seed: int, extra: tuple[float, ...] = ()) -> torch.Tensor:
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed))
    x[:: max(1, n // 7)] = -0.0
    for i, value in enumerate(extra):
        x[(i * 7919) % n] = value
    return x


def reference_breadcrumbs(x: torch.Tensor, density: float, gamma: float) -> torch.Tensor:
    n = x.numel()
    target, n_top = int(density * n), int(gamma * n)
    dropped_top = max(0, n - max(0, n - target - n_top) - target)
    keep = _rank_band_mask(x, dropped_top, dropped_top + target)
    return x.clone().masked_fill_(~keep.view_as(x), 0.0)


@pytest.mark.parametrize("extra", [[], [float("inf"), float("-inf")], [float("nan")]])
@pytest.mark.parametrize("make", [randn, heavy_ties])
@pytest.mark.parametrize("n", [1, 2, 7, 70_001])
@pytest.mark.parametrize("density,gamma", [(0.5, 0.01), (0.1, 0.0), (0.6, 0.5), (0.9, 0.3), (0.0, 0.2), (0.3, 0.9)])
def test_breadcrumbs_in_place_band_gives_the_reference_bits(make, n, extra, density, gamma):
    x = make(n, n, extra if n > 2 else [])
    assert torch.equal(bits(outlier_prune_(x.clone(), density, gamma)), bits(reference_breadcrumbs(x, density, gamma)))


def test_breadcrumbs_hand_computed():
    x = torch.tensor([3.0, -1.0, 2.0, -2.0, 0.5, -0.0, 1.0, 4.0, -0.5, 0.25])
    # n = 10: drop the top int(0.2 * 10) = 2 (4, 3), keep the next int(0.5 * 10) = 5: 2, -2, -1, 1 (ties: earlier
    # first) and 0.5 (before -0.5)
    got = outlier_prune_(x.clone(), 0.5, 0.2)
    assert got.tolist() == [0.0, -1.0, 2.0, -2.0, 0.5, 0.0, 1.0, 0.0, 0.0, 0.0]
    assert bits(got)[5] == 0  # the dropped -0 becomes +0, as masked_fill makes it


@pytest.mark.parametrize("extra", [[], [float("inf")], [float("nan")]])
def test_drop_cut_is_the_complement_of_keep_cut(extra):
    x = heavy_ties(100_003, 4, extra)
    for m in (1, 5_000, 50_000, 100_002):
        cut = selection.top_cut(x, m)
        inside = selection.cut_mask(x, cut)
        expected = x.clone().masked_fill_(inside, 0.0)
        assert torch.equal(bits(selection.drop_cut_(x.clone(), cut)), bits(expected))
