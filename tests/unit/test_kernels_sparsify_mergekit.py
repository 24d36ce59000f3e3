"""mergekit 0.1.5's sparsifiers (TIES magnitude, DARE Bernoulli, Breadcrumbs outliers, DELLA MagPrune) on tensors
small enough to work out by hand, their edge cases, and the fixed order of their random draws."""

from __future__ import annotations

import pytest
import torch

from kernels.errors import InvalidParameterError
from kernels.sparsify import bernoulli_prune_, della_keep_probability, della_prune_, magnitude_prune_, outlier_prune_

T = torch.tensor


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def close(actual: torch.Tensor, expected: list | torch.Tensor, atol: float = 1e-6) -> bool:
    return torch.allclose(actual, torch.as_tensor(expected, dtype=torch.float32), atol=atol, rtol=0)


# --- magnitude (TIES) -------------------------------------------------------------------------------------------


def test_magnitude_keeps_the_largest_and_rescales_to_the_l1_norm():
    # k = int(0.5 * 4) = 2 keeps 4 and -3; L1 before 10, after 7 -> survivors times 10/7
    assert torch.equal(magnitude_prune_(T([4.0, -1.0, 2.0, -3.0]), 0.5), T([4.0, 0.0, 0.0, -3.0]))
    assert close(magnitude_prune_(T([4.0, -1.0, 2.0, -3.0]), 0.5, rescale=True), [40 / 7, 0.0, 0.0, -30 / 7])


def test_magnitude_density_bounds():
    x = T([1.0, -2.0, 3.0])
    assert torch.equal(magnitude_prune_(x.clone(), 0.0, rescale=True), torch.zeros(3))
    assert torch.equal(magnitude_prune_(x.clone(), 1.0, rescale=True), x)  # no pruning, nothing to rescale
    # a positive density keeps at least one entry: max(1, int(0.1 * 3)) = 1
    assert torch.equal(magnitude_prune_(x.clone(), 0.1), T([0.0, 0.0, 3.0]))


def test_magnitude_ties_at_the_threshold_keep_the_first_by_position():
    # k = int(0.6 * 5) = 3: -3 and the first two of the three entries of magnitude 1
    assert torch.equal(magnitude_prune_(T([1.0, -1.0, 1.0, 0.5, -3.0]), 0.6), T([1.0, -1.0, 0.0, 0.0, -3.0]))


def test_magnitude_rescale_of_a_zero_vector_stays_zero():
    assert torch.equal(magnitude_prune_(torch.zeros(4), 0.5, rescale=True), torch.zeros(4))


# --- magnitude outliers (Breadcrumbs) ---------------------------------------------------------------------------

ONE_TO_TEN = [float(v) for v in range(1, 11)]


def test_breadcrumbs_drops_the_top_gamma_then_keeps_density():
    # n = 10: int(0.1 * 10) = 1 largest dropped (10), the next int(0.5 * 10) = 5 kept (9, 8, 7, 6, 5)
    out = outlier_prune_(T(ONE_TO_TEN), density=0.5, gamma=0.1)
    assert out.tolist() == [0, 0, 0, 0, 5, 6, 7, 8, 9, 0]


def test_breadcrumbs_gamma_zero_is_a_top_k():
    assert outlier_prune_(T(ONE_TO_TEN), density=0.3, gamma=0.0).tolist() == [0] * 7 + [8, 9, 10]


def test_breadcrumbs_gamma_plus_density_above_one_keeps_density():
    # target 6, n_top 5: only 10 - 6 = 4 of the largest can go, so the 6 smallest stay
    assert outlier_prune_(T(ONE_TO_TEN), density=0.6, gamma=0.5).tolist() == [1, 2, 3, 4, 5, 6, 0, 0, 0, 0]


def test_breadcrumbs_density_bounds():
    assert torch.equal(outlier_prune_(T(ONE_TO_TEN), density=0.0, gamma=0.1), torch.zeros(10))
    assert torch.equal(outlier_prune_(T(ONE_TO_TEN), density=1.0, gamma=0.5), T(ONE_TO_TEN))
    # no minimum of one entry (unlike TIES): int(0.05 * 10) = 0 kept
    assert torch.equal(outlier_prune_(T(ONE_TO_TEN), density=0.05, gamma=0.0), torch.zeros(10))


def test_breadcrumbs_ties_rank_the_earlier_position_as_larger():
    # four equal magnitudes: the first counts as the largest (dropped by gamma), the next two are kept
    assert outlier_prune_(T([2.0, -2.0, 2.0, 2.0]), density=0.5, gamma=0.25).tolist() == [0, -2, 2, 0]


def test_breadcrumbs_rescale_matches_the_l1_norm():
    # kept 5 + 6 + 7 + 8 + 9 = 35 of 55
    out = outlier_prune_(T(ONE_TO_TEN), density=0.5, gamma=0.1, rescale=True)
    assert close(out, [0, 0, 0, 0, *(v * 55 / 35 for v in (5, 6, 7, 8, 9)), 0], atol=1e-5)


# --- Bernoulli (DARE) -------------------------------------------------------------------------------------------


def test_dare_keeps_exactly_the_entries_whose_draw_is_below_density():
    x = torch.arange(1.0, 1001.0)
    expected = x * (torch.rand(1000, generator=gen(5)) < 0.3)  # the draw order: one uniform per entry, row-major
    assert torch.equal(bernoulli_prune_(x.clone(), 0.3, gen(5), rescale=False), expected)


def test_dare_rescale_matches_the_l1_norm_not_one_over_density():
    x = torch.arange(1.0, 1001.0)
    kept = x * (torch.rand(1000, generator=gen(5)) < 0.3)
    out = bernoulli_prune_(x.clone(), 0.3, gen(5), rescale=True)
    assert torch.allclose(out, kept * (x.sum() / kept.sum()), rtol=1e-6)
    assert out.sum().item() == pytest.approx(x.sum().item(), rel=1e-6)


def test_dare_kept_fraction_is_density_statistically():
    out = bernoulli_prune_(torch.ones(200_000), 0.3, gen(9), rescale=False)
    assert (out != 0).float().mean().item() == pytest.approx(0.3, abs=0.005)


def test_dare_same_seed_same_bits_other_seed_other_bits():
    x = torch.randn(5000, generator=gen(1))
    first = bernoulli_prune_(x.clone(), 0.5, gen(3))
    assert torch.equal(first, bernoulli_prune_(x.clone(), 0.5, gen(3)))
    assert not torch.equal(first, bernoulli_prune_(x.clone(), 0.5, gen(4)))


def test_dare_density_zero_and_one_draw_nothing():
    g = gen(2)
    state = g.get_state()
    x = T([1.0, 2.0])
    assert torch.equal(bernoulli_prune_(x.clone(), 0.0, g), torch.zeros(2))
    assert torch.equal(bernoulli_prune_(x.clone(), 1.0, g), x)
    assert torch.equal(g.get_state(), state)


# --- DELLA MagPrune ---------------------------------------------------------------------------------------------


def test_della_probability_rises_with_magnitude_rank():
    # ascending ranks 0 (0.1), 2 (-0.5), 1 (0.3) of n = 3: 0.5 - 0.2 + 0.4 * r / 2
    assert close(della_keep_probability(T([0.1, -0.5, 0.3]), 0.5, 0.2), [0.3, 0.7, 0.5])


def test_della_ranks_each_row_separately():
    probability = della_keep_probability(T([[3.0, 1.0], [1.0, 3.0]]), 0.5, 0.2)
    assert close(probability, [[0.7, 0.3], [0.3, 0.7]])


def test_della_equal_magnitudes_rank_by_position_and_single_entry_rows_get_density():
    assert close(della_keep_probability(T([2.0, -2.0, 2.0]), 0.5, 0.2), [0.3, 0.5, 0.7])
    assert close(della_keep_probability(T([[5.0], [6.0]]), 0.4, 0.1), [[0.4], [0.4]])


def test_della_keeps_exactly_the_entries_whose_draw_is_below_their_probability():
    x = torch.randn(6, 50, generator=gen(1))
    ranks = x.abs().argsort(dim=1, stable=True).argsort(dim=1).float()
    probability = 0.4 - 0.15 + 2 * 0.15 * ranks / 49
    expected = x * (torch.rand(300, generator=gen(7)).view(6, 50) < probability)
    assert torch.equal(della_prune_(x.clone(), 0.4, 0.15, gen(7), rescale=False), expected)


def test_della_rescale_matches_the_l1_norm():
    x = torch.randn(400, generator=gen(2))
    out = della_prune_(x.clone(), 0.5, 0.2, gen(8), rescale=True)
    assert out.abs().sum().item() == pytest.approx(x.abs().sum().item(), rel=1e-6)


def test_della_kept_fraction_follows_rank_statistically():
    x = torch.linspace(0.01, 1.0, 100_000)
    kept = della_prune_(x.clone(), 0.5, 0.2, gen(1), rescale=False) != 0
    assert kept.float().mean().item() == pytest.approx(0.5, abs=0.01)
    assert kept[:10_000].float().mean().item() == pytest.approx(0.32, abs=0.02)  # ranks 0-10%: p 0.30-0.34
    assert kept[-10_000:].float().mean().item() == pytest.approx(0.68, abs=0.02)  # ranks 90-100%: p 0.66-0.70


@pytest.mark.parametrize(("density", "epsilon"), [(0.5, 0.5), (0.9, 0.1), (0.2, 0.2), (0.3, 0.35)])
def test_della_density_plus_minus_epsilon_must_lie_strictly_inside_zero_one(density, epsilon):
    with pytest.raises(InvalidParameterError) as info:
        della_prune_(torch.ones(4), density, epsilon, gen())
    assert info.value.param == "epsilon"


def test_della_epsilon_just_inside_bounds_and_density_bounds():
    assert (della_prune_(torch.ones(10), 0.5, 0.49, gen(), rescale=False) != 0).any()
    assert torch.equal(della_prune_(T([1.0, 2.0]), 1.0, 0.9, gen()), T([1.0, 2.0]))  # density 1: no check, no draw
    assert torch.equal(della_prune_(T([1.0, 2.0]), 0.0, 0.9, gen()), torch.zeros(2))


def test_della_ranks_along_dimension_one_of_higher_rank_tensors():
    # shape (1, 3, 2): mergekit ranks along dim 1, so each (i, :, k) is one row of 3
    x = T([[[1.0, 5.0], [3.0, 4.0], [2.0, 6.0]]])
    # column k = 0: [1, 3, 2] -> ranks [0, 2, 1]; k = 1: [5, 4, 6] -> ranks [1, 0, 2]; p = 0.3 + 0.2 * r
    assert close(della_keep_probability(x, 0.5, 0.2), [[[0.3, 0.5], [0.7, 0.3], [0.5, 0.7]]])
