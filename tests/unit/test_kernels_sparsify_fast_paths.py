"""The in-place float paths of kernels.sparsify give the bits (signed zeros and NaN included) of the mask-based
reference: Model Breadcrumbs' rank band (keep below one cut, drop the top cut), selection.drop_cut_, and DELLA's
blocked rank-draw-mask (the same draws, ranks and kept set as the full-size probability tensor)."""

from __future__ import annotations

import pytest
import torch

from kernels import selection, sparsify
from kernels.sparsify import (
    _della_keep_blocked_,
    _draw_keep_,
    _rank_band_mask,
    della_keep_probability,
    della_prune_,
    outlier_prune_,
)

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


def reference_della_keep(x: torch.Tensor, density: float, epsilon: float, seed: int) -> torch.Tensor:
    out = x.clone()
    _draw_keep_(out, della_keep_probability(out, density, epsilon), torch.Generator().manual_seed(seed))
    return out


@pytest.mark.parametrize("shape", [(1,), (5,), (3, 1), (1, 7), (100, 3), (40_000,), (300, 1024), (7, 33_333)])
@pytest.mark.parametrize("make", [randn, heavy_ties])
@pytest.mark.parametrize("density,epsilon", [(0.5, 0.1), (0.3, 0.29), (0.9, 0.05)])
def test_della_blocked_keep_gives_the_reference_bits(make, shape, density, epsilon):
    n = 1
    for size in shape:
        n *= size
    x = make(n, n, (float("inf"), float("-inf"), float("nan")) if n > 2 else ()).view(shape)
    got = x.clone()
    _della_keep_blocked_(got.view(1, -1) if got.dim() < 2 else got, density, epsilon, torch.Generator().manual_seed(5))
    assert torch.equal(bits(got), bits(reference_della_keep(x, density, epsilon, 5)))


def test_della_draws_cross_random_chunks_and_blocks_like_the_reference(monkeypatch):
    monkeypatch.setattr(sparsify, "RANDOM_CHUNK", 1000)  # draws of 1000: blocks of rows straddle them
    monkeypatch.setattr(sparsify, "DELLA_BLOCK", 700)
    x = randn(97 * 31, 3).view(97, 31)
    for rescale in (False, True):
        got = della_prune_(x.clone(), 0.4, 0.2, torch.Generator().manual_seed(9), rescale)
        expected = reference_della_keep(x, 0.4, 0.2, 9)
        if rescale:
            expected = sparsify._rescale_l1_(expected, float(sparsify.stable_abs_sum(x)))
        assert torch.equal(bits(got), bits(expected))


def test_della_prune_hand_computed():
    # one row of 3: ascending ranks of |x| are 2, 0, 1, so p = 0.3 + 0.4 * r / 2 = 0.7, 0.3, 0.5; the first three
    # draws of seed 0 are 0.4963, 0.7682, 0.0885: keep the first (0.50 < 0.7), drop the second, keep the third
    assert torch.rand(3, generator=torch.Generator().manual_seed(0)).tolist()[:1] == pytest.approx([0.4963], abs=1e-4)
    got = della_prune_(torch.tensor([3.0, -1.0, 2.0]), 0.5, 0.2, torch.Generator().manual_seed(0), rescale=False)
    assert got.tolist() == [3.0, -0.0, 2.0] and bits(got)[1] == bits(torch.tensor(-0.0))


def reference_draw_keep(x: torch.Tensor, probability, seed: int) -> torch.Tensor:
    """The former _draw_keep_: multiply by the bool ``draw < probability``."""
    out, generator = x.clone(), torch.Generator().manual_seed(seed)
    flat = out.view(-1)
    flat_probability = probability.reshape(-1) if isinstance(probability, torch.Tensor) else None
    for start in range(0, flat.numel(), sparsify.RANDOM_CHUNK):
        piece = flat[start : start + sparsify.RANDOM_CHUNK]
        draws = torch.rand(piece.numel(), generator=generator)
        threshold = probability if flat_probability is None else flat_probability[start : start + piece.numel()]
        piece.mul_(draws < threshold)
    return out


@pytest.mark.parametrize("density", [0.5, 0.1, 1 / 3, 0.9, 1e-6, 0.5 + 1e-12])
@pytest.mark.parametrize("make", [randn, heavy_ties])
def test_bernoulli_float_mask_gives_the_reference_bits(monkeypatch, make, density):
    monkeypatch.setattr(sparsify, "RANDOM_CHUNK", 50_000)
    x = make(120_001, 2, (float("inf"), float("-inf"), float("nan")))
    got = x.clone()
    sparsify._draw_keep_(got, density, torch.Generator().manual_seed(4))
    assert torch.equal(bits(got), bits(reference_draw_keep(x, density, 4)))
    probability = torch.rand(x.shape, generator=torch.Generator().manual_seed(6))
    got = x.clone()
    sparsify._draw_keep_(got, probability, torch.Generator().manual_seed(4))
    assert torch.equal(bits(got), bits(reference_draw_keep(x, probability, 4)))


def test_below_as_float_at_the_boundary():
    # a draw equal to the float32 probability is not below it, even when the float64 probability is a bit above
    draws = torch.tensor([0.5, 0.25, 0.75, 0.0])
    assert bits(sparsify._below_as_float_(torch.rsub(draws, 0.5 + 1e-12))).tolist() == [
        bits(torch.tensor(v)).item() for v in (0.0, 1.0, 0.0, 1.0)
    ]
