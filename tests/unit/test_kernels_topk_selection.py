"""The linear-time top-k selection (kernels.selection) keeps exactly the set a sort-based reference keeps: the m
largest magnitudes, equal magnitudes ranked by position (earlier = larger), on random, heavy-tie and edge-case
tensors of 1 element to a few million, through every internal path (direct, sampled band, radix histogram)."""

from __future__ import annotations

import pytest
import torch

from kernels import selection
from kernels.sparsify import della_keep_probability, magnitude_prune_, outlier_prune_, top_k_mask

SPECIALS = [0.0, -0.0, 1e-45, -1e-45, 3e-39, -3e-39, 1.0, -1.0, 2.0, float("inf"), float("-inf")]


def ranked(values: torch.Tensor) -> torch.Tensor:
    """Flat positions from the largest magnitude down; a stable sort keeps equal magnitudes in position order."""
    return torch.sort(values.reshape(-1).abs(), descending=True, stable=True).indices


def reference_band(values: torch.Tensor, first: int, stop: int, order: torch.Tensor | None = None) -> torch.Tensor:
    """Mask of the entries of descending rank first <= r < stop (``order``: ``ranked(values)``, if known)."""
    mask = torch.zeros(values.numel(), dtype=torch.bool)
    mask[(ranked(values) if order is None else order)[first:stop]] = True
    return mask


def randn(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 0.01


def heavy_ties(n: int, seed: int) -> torch.Tensor:
    """Entries drawn from a few special values: zeros of both signs, denormals, +-1, 2, +-inf."""
    picks = torch.randint(len(SPECIALS), (n,), generator=torch.Generator().manual_seed(seed))
    return torch.tensor(SPECIALS, dtype=torch.float32)[picks]


def counts_for(n: int) -> list[int]:
    return sorted({m for m in (1, 2, n // 3, n // 2, n - 2, n - 1) if 0 < m < n})


SIZES = [2, 3, 5, 17, 1000, selection.DIRECT_LIMIT, selection.DIRECT_LIMIT + 1, 100_003, 2_500_001]


@pytest.mark.parametrize("n", SIZES)
def test_top_k_equals_the_sort_reference_on_random_tensors(n):
    x = randn(n, n)
    order = ranked(x)
    for m in counts_for(n):
        assert torch.equal(top_k_mask(x, m), reference_band(x, 0, m, order)), m


@pytest.mark.parametrize("n", [2, 11, 1000, 100_003, 700_000])
def test_top_k_equals_the_sort_reference_on_heavy_ties(n):
    x = heavy_ties(n, n)
    order = ranked(x)
    for m in counts_for(n) + [int(n * 0.09), int(n * 0.55)]:
        if 0 < m < n:
            assert torch.equal(top_k_mask(x, m), reference_band(x, 0, m, order)), m


def test_all_equal_magnitudes_keep_the_first_positions():
    x = torch.tensor([1.0, -1.0] * 50_000)
    for m in (1, 31_999, 32_000, 32_001, 50_001, 99_999):
        expected = torch.zeros(100_000, dtype=torch.bool)
        expected[:m] = True
        assert torch.equal(top_k_mask(x, m), expected), m


def test_zeros_and_a_few_values():
    x = torch.zeros(300_000)
    x[[5, 70_000, 299_999]] = torch.tensor([-3.0, 2.0, 1.0])
    order = ranked(x)
    for m in (1, 2, 3, 4, 150_000, 299_999):
        assert torch.equal(top_k_mask(x, m), reference_band(x, 0, m, order)), m


def test_bounds_of_k():
    x = randn(10, 0)
    assert not top_k_mask(x, 0).any() and top_k_mask(x, 10).all() and top_k_mask(x, 12).all()
    assert top_k_mask(torch.tensor([-5.0]), 1).tolist() == [True]


def orders(source: torch.Tensor, m: int):
    keys = selection.magnitude_keys
    return (selection._direct(source, m, keys), selection._banded(source, m, keys), selection._radix(source, m))


@pytest.mark.parametrize("make", [randn, heavy_ties])
def test_every_path_finds_the_same_threshold(make):
    x = make(400_000, 7)
    for m in (1, 1000, 200_000, 399_999):
        direct, banded, radix = orders(x, m)
        assert radix == direct
        assert banded in (None, direct)  # None: band too wide (heavy ties), the radix path takes over
    assert orders(randn(400_000, 8), 123_456)[1] is not None  # random data takes the sampled band


# 0.99: a top cut small enough to band without its high end (fewer ties, or the sample sees only the tied value)
@pytest.mark.parametrize("quantile,ties", [(0.5, 6000), (0.99, 600)])
def test_ties_at_the_threshold_in_many_pieces_are_kept_by_position_from_the_band(quantile, ties):
    """Threshold ties spread over many pieces: the sampled band holds every tie, and the cut keeps the first ones
    by position (located from the band's keys, without another pass over the tensor)."""
    x = randn(1_000_000, 12)
    tied = torch.randperm(x.numel(), generator=torch.Generator().manual_seed(13))[:ties]
    value = float(x.abs().quantile(quantile))
    x[tied] = torch.where(torch.arange(ties) % 2 == 0, value, -value)
    order = ranked(x)
    above, equal = int(torch.count_nonzero(x.abs() > value)), int(torch.count_nonzero(x.abs() == value))
    assert equal >= ties
    for m in (above + 1, above + equal // 2, above + equal - 1):
        found = selection._banded(x, m, selection.magnitude_keys)
        assert found is not None and found.band is not None and found.equal == equal
        assert torch.equal(top_k_mask(x, m), reference_band(x, 0, m, order)), m


def test_a_missed_bracket_falls_back_to_an_exact_answer(monkeypatch):
    x = randn(300_000, 3)
    monkeypatch.setattr(selection, "_bracket", lambda source, m, keys_of: (0, 1))  # brackets nothing useful
    assert selection._banded(x, 150_000, selection.magnitude_keys) is None
    assert torch.equal(top_k_mask(x, 150_000), reference_band(x, 0, 150_000))
    # a small cut, banded from the low end alone, whose low end is above its threshold
    monkeypatch.setattr(selection, "_bracket", lambda source, m, keys_of: (0x7F000000, 0x7F000001))
    assert 1000 <= x.numel() * selection.TOP_ONLY and selection._banded(x, 1000, selection.magnitude_keys) is None
    assert torch.equal(top_k_mask(x, 1000), reference_band(x, 0, 1000))


@pytest.mark.parametrize("density", [1e-9, 0.01, 0.5, 0.9, 1 - 1e-6])
@pytest.mark.parametrize("make", [randn, heavy_ties])
def test_magnitude_prune_keeps_the_reference_set(make, density):
    x = make(300_007, 5)  # above DIRECT_LIMIT: the sampled band (or the radix histogram) selects
    k = max(1, int(density * x.numel()))
    expected = torch.where(reference_band(x, 0, k), x, 0.0)
    assert torch.equal(magnitude_prune_(x.clone(), density), expected)


def test_magnitude_prune_of_a_non_contiguous_tensor():
    x = randn(300 * 400, 1).view(300, 400).t()
    expected = torch.where(reference_band(x.contiguous(), 0, 60_000).view(400, 300), x, 0.0)
    assert torch.equal(magnitude_prune_(x.clone(), 0.5), expected)
    assert torch.equal(magnitude_prune_(x, 0.5), expected)


@pytest.mark.parametrize("make", [randn, heavy_ties])
@pytest.mark.parametrize("density,gamma", [(0.5, 0.01), (0.1, 0.0), (0.6, 0.5), (0.9, 0.3), (1e-6, 0.2)])
def test_breadcrumbs_keeps_the_reference_rank_band(make, density, gamma):
    x = make(280_000, 9)
    n = x.numel()
    target, n_top = int(density * n), int(gamma * n)
    dropped_top = max(0, n - max(0, n - target - n_top) - target)
    expected = torch.where(reference_band(x, dropped_top, dropped_top + target), x, 0.0)
    assert torch.equal(outlier_prune_(x.clone(), density, gamma), expected)


def test_selection_does_not_depend_on_the_thread_count():
    x = randn(1_000_003, 11)
    before = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            results.append((top_k_mask(x, 333_333), magnitude_prune_(x.clone(), 0.3)))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


def reference_della_probability(x: torch.Tensor, density: float, epsilon: float) -> torch.Tensor:
    """Ranks along dim 1 from a stable float argsort (the former kernel), as mergekit's formula."""
    rows = x.unsqueeze(0) if x.dim() < 2 else x
    magnitude = rows.abs().movedim(1, -1)
    ranks = magnitude.argsort(dim=-1, stable=True).argsort(dim=-1).float()
    length = magnitude.shape[-1]
    probability = ranks.div_(length - 1).mul_(2).mul_(epsilon).add_(density - epsilon)
    return probability.movedim(-1, 1).reshape(x.shape)


@pytest.mark.parametrize("shape", [(5000,), (300, 257), (7, 64, 33)])
@pytest.mark.parametrize("make", [randn, heavy_ties])
def test_della_ranks_from_int_keys_equal_the_float_argsort(make, shape):
    x = make(int(torch.tensor(shape).prod()), 4).view(shape)
    assert torch.equal(della_keep_probability(x, 0.4, 0.1), reference_della_probability(x, 0.4, 0.1))
