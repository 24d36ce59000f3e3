"""Each strategy against numbers worked out by hand on tiny tensors."""

from __future__ import annotations

import math

import pytest
import torch

from kernels.dare import dare
from kernels.errors import InvalidParameterError
from kernels.linear import linear
from kernels.reductions import stable_dot, stable_sum
from kernels.slerp import slerp
from kernels.sparsify import random_drop_, ranked_stochastic_prune_, top_magnitude_mask
from kernels.task_arithmetic import task_arithmetic
from kernels.ties import ties

T = torch.tensor


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --- slerp ---------------------------------------------------------------------------------------------------


def test_slerp_orthogonal_midpoint_is_on_the_arc():
    # theta = pi/2: both coefficients are sin(pi/4)/sin(pi/2) = 0.70710678
    out = slerp(T([1.0, 0.0]), T([0.0, 1.0]), 0.5)
    assert torch.allclose(out, T([0.70710678, 0.70710678]), atol=1e-7)


def test_slerp_uses_unnormalised_tensors():
    # v0 = [2, 0], v1 = [0, 4]: theta = pi/2, t = 1/3 -> c0 = sin(pi/3) = 0.8660254, c1 = sin(pi/6) = 0.5
    out = slerp(T([2.0, 0.0]), T([0.0, 4.0]), 1 / 3)
    assert torch.allclose(out, T([2 * 0.8660254, 4 * 0.5]), atol=1e-6)


def test_slerp_endpoints_are_exact():
    v0, v1 = T([0.3, -1.2, 2.0]), T([1.5, 0.2, -0.7])
    assert torch.equal(slerp(v0, v1, 0.0), v0)
    assert torch.equal(slerp(v0, v1, 1.0), v1)


def test_slerp_parallel_vectors_interpolate_linearly():
    # dot of normalised copies is 1 > 0.9995: lerp 0.75*[1,2] + 0.25*[2,4] = [1.25, 2.5]
    assert torch.allclose(slerp(T([1.0, 2.0]), T([2.0, 4.0]), 0.25), T([1.25, 2.5]))


def test_slerp_anti_parallel_vectors_interpolate_linearly():
    # dot = -1, |dot| > 0.9995: lerp 0.5*[1,1] + 0.5*[-3,-3] = [-1, -1] (slerp would divide by sin(pi) = 0)
    out = slerp(T([1.0, 1.0]), T([-3.0, -3.0]), 0.5)
    assert torch.allclose(out, T([-1.0, -1.0]))
    assert torch.isfinite(out).all()


def test_slerp_of_a_zero_tensor_stays_finite():
    out = slerp(torch.zeros(3), T([1.0, 2.0, 3.0]), 0.5)
    assert torch.isfinite(out).all()


# --- linear and task arithmetic ----------------------------------------------------------------------------


def test_linear_weighted_average():
    # (1*[1,2] + 3*[5,6]) / 4 = [4, 5]
    assert torch.equal(linear([T([1.0, 2.0]), T([5.0, 6.0])], [1.0, 3.0]), T([4.0, 5.0]))
    assert torch.equal(linear([T([1.0, 2.0]), T([5.0, 6.0])], [1.0, 3.0], normalize=False), T([16.0, 20.0]))


def test_linear_refuses_to_normalise_zero_weights():
    with pytest.raises(InvalidParameterError) as info:
        linear([T([1.0]), T([2.0])], [1.0, -1.0])
    assert info.value.param == "weight"


def test_task_arithmetic_with_negative_weight_and_lambda():
    base, a, b = T([1.0, 1.0]), T([2.0, 0.0]), T([1.0, 3.0])
    # deltas [1,-1], [0,2]; 0.5*[1,-1] - 1*[0,2] = [0.5, -2.5]; lambda 2 -> [1, -5]; + base -> [2, -4]
    assert torch.equal(task_arithmetic(base, [a, b], [0.5, -1.0], lam=2.0), T([2.0, -4.0]))


def test_task_arithmetic_normalize_divides_by_weight_sum():
    base, a, b = T([0.0]), T([4.0]), T([8.0])
    # (1*4 + 3*8) / 4 = 7
    assert torch.equal(task_arithmetic(base, [a, b], [1.0, 3.0], normalize=True), T([7.0]))


def test_kernels_never_modify_their_inputs():
    base, a, b = T([1.0, -2.0, 3.0]), T([2.0, 2.0, 2.0]), T([0.0, -5.0, 4.0])
    copies = [x.clone() for x in (base, a, b)]
    ties(base, [a, b], [1.0, 1.0], [0.5, 0.5])
    dare(base, [a, b], [1.0, 1.0], [0.5, 0.5], gen())
    task_arithmetic(base, [a, b], [1.0, 1.0])
    slerp(a, b, 0.3)
    assert all(torch.equal(x, y) for x, y in zip((base, a, b), copies))


# --- TIES ------------------------------------------------------------------------------------------------------


def test_ties_hand_computed():
    base = torch.zeros(4)
    m1, m2 = T([1.0, -2.0, 3.0, 0.5]), T([-1.0, -1.0, 1.0, -0.25])
    # density 1: signs from sums [0, -3, 4, 0.25] -> [+, -, +, +]
    # entry 0: tie (sum 0) goes to +, only m1 agrees -> 1/1; entry 1: (-2-1)/2; entry 2: (3+1)/2; entry 3: 0.5/1
    assert torch.equal(ties(base, [m1, m2], [1.0, 1.0], [1.0, 1.0]), T([1.0, -1.5, 2.0, 0.5]))


def test_ties_trims_to_density_before_electing():
    base = torch.zeros(4)
    m1, m2 = T([1.0, -2.0, 3.0, 0.5]), T([-4.0, -1.0, 1.0, 0.25])
    # density 0.5 keeps 2 of 4: m1 -> [0, -2, 3, 0]; m2 keeps -4 and the first of its tied 1s -> [-4, -1, 0, 0]
    # sums [-4, -3, 3, 0] -> signs [-, -, +, +]; entry 0: -4/1, entry 1: (-2-1)/2, entry 2: 3/1, entry 3: nothing -> 0
    assert torch.equal(ties(base, [m1, m2], [1.0, 1.0], [0.5, 0.5]), T([-4.0, -1.5, 3.0, 0.0]))


def test_ties_weighted_disjoint_mean_and_lambda():
    base = T([1.0, 1.0])
    m1, m2 = T([3.0, 1.0]), T([5.0, 1.0])  # deltas [2, 0], [4, 0]
    # weights 1 and 3: (1*2 + 3*4) / (1 + 3) = 3.5; lambda 0.5 -> 1.75; + base 1 -> 2.75; entry 1 all zero -> base
    out = ties(base, [m1, m2], [1.0, 3.0], [1.0, 1.0], lam=0.5)
    assert torch.equal(out, T([2.75, 1.0]))


def test_ties_negative_weight_flips_the_vote():
    base = torch.zeros(1)
    # weighted deltas: 1*2 = 2 and -2*3 = -6; sum -4 -> sign -; only -6 agrees; divisor = -2 -> -6 / -2 = 3
    assert torch.equal(ties(base, [T([2.0]), T([3.0])], [1.0, -2.0], [1.0, 1.0]), T([3.0]))


def test_ties_all_zero_task_vectors_give_the_base():
    base = T([0.5, -0.5, 2.0])
    assert torch.equal(ties(base, [base.clone(), base.clone()], [1.0, 1.0], [0.5, 0.5]), base)


def test_ties_density_zero_gives_base_and_density_one_keeps_everything():
    base = T([1.0, 2.0])
    m = T([3.0, -1.0])
    assert torch.equal(ties(base, [m], [1.0], [0.0]), base)
    assert torch.equal(ties(base, [m], [1.0], [1.0]), m)


def test_top_magnitude_mask_keeps_exactly_k_with_ties_broken_by_position():
    x = T([1.0, -1.0, 1.0, 0.5, -3.0])
    # k = int(0.6 * 5) = 3: -3 and the first two of the three tied 1s
    assert top_magnitude_mask(x, 0.6).tolist() == [True, True, False, False, True]
    # a positive density keeps at least one entry: k = max(1, int(0.1 * 5)) = 1
    assert top_magnitude_mask(x, 0.1).tolist() == [False, False, False, False, True]


def test_ties_epsilon_prunes_by_rank_and_preserves_expectation():
    x = torch.linspace(0.01, 1.0, 20000)
    kept = ranked_stochastic_prune_(x.clone(), density=0.5, epsilon=0.2, generator=gen(1))
    survivors = kept != 0
    # small entries survive with probability ~0.3, large ones ~0.7
    assert 0.25 < survivors[:2000].float().mean() < 0.35
    assert 0.65 < survivors[-2000:].float().mean() < 0.75
    # survivors are divided by their keep probability, so the sum is unbiased
    assert abs(kept.sum().item() - x.sum().item()) / x.sum().item() < 0.03


def test_ties_epsilon_out_of_range_names_the_parameter():
    with pytest.raises(InvalidParameterError) as info:
        ranked_stochastic_prune_(torch.ones(4), density=0.9, epsilon=0.2, generator=gen())
    assert info.value.param == "epsilon"


# --- DARE ------------------------------------------------------------------------------------------------------


def test_dare_drop_rate_zero_is_task_arithmetic():
    base, a, b = T([1.0, 2.0]), T([2.0, 0.0]), T([0.0, 5.0])
    assert torch.equal(dare(base, [a, b], [1.0, 0.5], [0.0, 0.0], gen()), task_arithmetic(base, [a, b], [1.0, 0.5]))


def test_dare_rescale_preserves_the_expectation():
    delta = torch.ones(100_000)
    out = random_drop_(delta.clone(), 0.3, True, gen(7))
    # survivors are exactly 1 / 0.7, and about 70% survive, so the mean stays ~1
    values = out.unique()
    assert len(values) == 2 and values[0] == 0 and values[1].item() == pytest.approx(1 / 0.7)
    assert abs(out.mean().item() - 1.0) < 0.01
    assert abs((out == 0).float().mean().item() - 0.3) < 0.01


def test_dare_without_rescale_keeps_survivors_unchanged():
    out = random_drop_(torch.full((1000,), 2.0), 0.5, False, gen(3))
    assert set(out.unique().tolist()) == {0.0, 2.0}


def test_dare_with_consensus_uses_ties_election():
    base = torch.zeros(2)
    a, b = T([1.0, -1.0]), T([-3.0, -1.0])
    # no drop: sums [-2, -2] -> both -; entry 0: only -3 agrees; entry 1: (-1 - 1) = -2 (no normalize by default)
    assert torch.equal(dare(base, [a, b], [1.0, 1.0], [0.0, 0.0], gen(), consensus=True), T([-3.0, -2.0]))


def test_dare_same_seed_same_bits():
    base, a = torch.zeros(5000), torch.randn(5000, generator=gen(2))
    first = dare(base, [a], [1.0], [0.6], gen(11))
    again = dare(base, [a], [1.0], [0.6], gen(11))
    other = dare(base, [a], [1.0], [0.6], gen(12))
    assert torch.equal(first, again)
    assert not torch.equal(first, other)


# --- reductions ------------------------------------------------------------------------------------------------


def test_stable_reductions_do_not_depend_on_thread_count():
    x = torch.randn(3_000_001, generator=gen(5))
    y = torch.randn(3_000_001, generator=gen(6))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = (stable_sum(x).item(), stable_dot(x, y).item())
        torch.set_num_threads(2)
        two = (stable_sum(x).item(), stable_dot(x, y).item())
    finally:
        torch.set_num_threads(before)
    assert one == two
    assert math.isclose(one[1], float((x.double() * y.double()).sum()), rel_tol=1e-12)


def test_stable_reductions_reuse_their_threads_scratch_and_keep_their_values():
    """A merge takes a norm or a dot of every delta: the float64 chunks are the calling thread's, kept from one call
    to the next (fresh ones cost their page faults every call), another thread gets its own, and a call's values
    do not depend on what the previous call left in them."""
    from concurrent.futures import ThreadPoolExecutor

    from kernels import reductions

    x, y = torch.randn(2_000_003, generator=gen(7)), torch.randn(2_000_003, generator=gen(8))
    first = stable_dot(x, y).item()
    kept = [b.data_ptr() for b in reductions._kept.buffers]
    assert math.isclose(stable_sum(y).item(), float(y.double().sum()), rel_tol=1e-12)  # between: another call
    assert stable_dot(x, y).item() == first
    assert [b.data_ptr() for b in reductions._kept.buffers] == kept
    with ThreadPoolExecutor(1) as pool:
        other = pool.submit(lambda: (stable_dot(x, y).item(), [b.data_ptr() for b in reductions._kept.buffers]))
        value, theirs = other.result()
    assert value == first and not set(theirs) & set(kept)
