"""Every mergekit method's kernel (through ``kernels.registry.METHODS``) against numbers worked out by hand on tiny
tensors, with each method's edge cases."""

from __future__ import annotations

import math

import pytest
import torch

from kernels.errors import InvalidParameterError
from kernels.registry import get_method

T = torch.tensor
R2 = math.sqrt(0.5)  # cos(pi/4) = sin(pi/4)


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def run(method: str, tensors, base_index=0, generator=None, **params) -> torch.Tensor:
    """Call a method's kernel the way the executor does: global values (defaults filled in) and one resolved
    dict per input; a list value gives one value per input (None for the base)."""
    spec = get_method(method)
    global_params = {p.name: params.get(p.name, p.default) for p in spec.params if p.scope == "global"}
    model_params = []
    for position in range(len(tensors)):
        mine = {}
        for p in spec.params:
            if p.scope != "global":
                value = params.get(p.name, p.default)
                mine[p.name] = value[position] if isinstance(value, list) else value
        model_params.append(mine)
    tensors = [torch.as_tensor(t, dtype=torch.float32) for t in tensors]
    return spec.kernel(tensors, base_index, global_params, model_params, generator)


def close(actual: torch.Tensor, expected, atol: float = 1e-6) -> bool:
    return torch.allclose(actual, torch.as_tensor(expected, dtype=torch.float32), atol=atol, rtol=0)


# --- linear -----------------------------------------------------------------------------------------------------


def test_linear_is_a_weighted_average_of_every_input():
    # (1*[1,2] + 3*[5,6]) / 4 = [4, 5]; base_index is ignored: the base is just another input
    assert close(run("linear", [[1.0, 2.0], [5.0, 6.0]], None, weight=[1.0, 3.0]), [4.0, 5.0])
    assert close(run("linear", [[1.0, 2.0], [5.0, 6.0]], 0, weight=[1.0, 3.0], normalize=False), [16.0, 20.0])


def test_linear_single_model_and_zero_weight_sum():
    assert close(run("linear", [[3.0, -1.0]], None, weight=[2.0]), [3.0, -1.0])
    with pytest.raises(InvalidParameterError) as info:  # mergekit would divide by zero (inf/nan)
        run("linear", [[1.0], [2.0]], None, weight=[1.0, -1.0])
    assert info.value.param == "weight"


# --- task arithmetic family (generalized task arithmetic) -------------------------------------------------------


def test_task_arithmetic_hand_computed():
    # deltas [1,-1] and [0,2]; 0.5*[1,-1] - 1*[0,2] = [0.5,-2.5]; lambda 2 -> [1,-5]; + base [1,1] -> [2,-4]
    out = run("task_arithmetic", [[1.0, 1.0], [2.0, 0.0], [1.0, 3.0]], weight=[None, 0.5, -1.0], **{"lambda": 2.0})
    assert close(out, [2.0, -4.0])


def test_task_arithmetic_ignores_density_and_rescale():
    plain = run("task_arithmetic", [[0.0, 0.0], [1.0, -3.0]], weight=[None, 1.0])
    assert close(
        run("task_arithmetic", [[0.0, 0.0], [1.0, -3.0]], weight=[None, 1.0], density=[None, 0.1], rescale=True), plain
    )


def test_normalize_with_weights_summing_to_zero_does_not_divide():
    # |sum of weights| < 1e-8: mergekit divides by 1, so the result is base + a - b
    out = run("task_arithmetic", [[1.0, 1.0], [2.0, 0.0], [1.0, 3.0]], weight=[None, 1.0, -1.0], normalize=True)
    assert close(out, [2.0, -2.0])


def test_no_models_besides_the_base_gives_the_base():
    assert close(run("ties", [[1.0, 2.0]], weight=[None]), [1.0, 2.0])


def test_ties_trims_elects_and_takes_the_disjoint_mean():
    # density 0.5 keeps 2 of 4: m1 -> [0,-2,3,0]; m2 keeps -4 and the first of its tied |1| -> [-4,-1,0,0]
    # sums [-4,-3,3,0] -> signs [-,-,+,+]; entry 0: -4/1; entry 1: (-2-1)/2; entry 2: 3/1; entry 3: nothing
    out = run(
        "ties",
        [[0.0] * 4, [1.0, -2.0, 3.0, 0.5], [-4.0, -1.0, 1.0, 0.25]],
        weight=[None, 1.0, 1.0],
        density=[None, 0.5, 0.5],
    )
    assert close(out, [-4.0, -1.5, 3.0, 0.0])


def test_ties_with_rescale_matches_each_trimmed_l1_norm():
    # m1 [0,-2,3,0] * 6.5/5 = [0,-2.6,3.9,0]; m2 [-4,-1,0,0] * 6.25/5 = [-5,-1.25,0,0]
    # signs [-,-,+,+]: [-5, (-2.6-1.25)/2, 3.9, 0]
    out = run(
        "ties",
        [[0.0] * 4, [1.0, -2.0, 3.0, 0.5], [-4.0, -1.0, 1.0, 0.25]],
        weight=[None, 1.0, 1.0],
        density=[None, 0.5, 0.5],
        rescale=True,
    )
    assert close(out, [-5.0, -1.925, 3.9, 0.0], atol=1e-5)


def test_ties_zero_sign_sum_elects_plus_and_divides_by_the_agreeing_weights():
    # weighted deltas 1*2 = 2 and -1*2 = -2: sum 0 elects +, only the first agrees: 2 / 1
    assert close(run("ties", [[0.0], [2.0], [2.0]], weight=[None, 1.0, -1.0]), [2.0])


def test_ties_single_model_with_normalize_is_the_model():
    # delta [2,-3] * 0.5 / 0.5 + base
    assert close(run("ties", [[1.0, 2.0], [3.0, -1.0]], weight=[None, 0.5]), [3.0, -1.0])


def test_ties_zero_task_vectors_and_identical_models_give_the_base():
    base = [0.5, -0.5, 2.0]
    assert close(run("ties", [base, base, base], weight=[None, 1.0, 2.0], density=[None, 0.5, 0.5]), base)


def test_ties_density_zero_drops_the_model_and_density_one_keeps_it_whole():
    assert close(run("ties", [[1.0, 2.0], [3.0, -1.0]], weight=[None, 1.0], density=[None, 0.0]), [1.0, 2.0])
    assert close(run("ties", [[1.0, 2.0], [3.0, -1.0]], weight=[None, 1.0], density=[None, 1.0]), [3.0, -1.0])


def test_breadcrumbs_and_its_ties_variant():
    base = [0.0] * 10
    model = [float(v) for v in range(1, 11)]
    # drop the largest (gamma 0.1), keep the next 5: weight 0.5, no normalize
    out = run("breadcrumbs", [base, model], weight=[None, 0.5], density=[None, 0.5], gamma=[None, 0.1])
    assert close(out, [0, 0, 0, 0, 2.5, 3, 3.5, 4, 4.5, 0])
    other = [-v for v in model]  # the opposite change, weight 1: wins every vote where both survive
    out = run(
        "breadcrumbs_ties",
        [base, model, other],
        weight=[None, 0.5, 1.0],
        density=[None, 0.5, 0.3],
        gamma=[None, 0.1, 0.0],
    )
    # model keeps 5..9 (x0.5), other keeps -8,-9,-10: sums elect - at 8, 9, 10 (-8+4, -9+4.5, -10), + at 5, 6, 7
    assert close(out, [0, 0, 0, 0, 2.5, 3, 3.5, -8, -9, -10])


def test_dare_linear_keeps_entries_by_the_generator_in_model_order():
    # two models: the first model's mask is the first n draws, the second's the next n
    n = 1000
    draws = torch.rand(2 * n, generator=gen(4))
    mask_a, mask_b = draws[:n] < 0.5, draws[n:] < 0.5
    out = run(
        "dare_linear",
        [torch.zeros(n), torch.ones(n), 2 * torch.ones(n)],
        generator=gen(4),
        weight=[None, 1.0, 1.0],
        density=[None, 0.5, 0.5],
        rescale=False,
    )
    assert torch.equal(out, mask_a.float() + 2 * mask_b.float())


def test_dare_a_model_with_density_zero_or_one_draws_nothing():
    n = 500
    mask = torch.rand(n, generator=gen(6)) < 0.4
    out = run(
        "dare_linear",
        [torch.zeros(n), torch.ones(n), torch.ones(n), 3 * torch.ones(n)],
        generator=gen(6),
        weight=[None, 1.0, 1.0, 1.0],
        density=[None, 0.0, 1.0, 0.4],
        rescale=False,
    )
    assert torch.equal(out, 1.0 + 3 * mask.float())


def test_dare_rescale_keeps_the_l1_norm_and_same_seed_same_bits():
    x = torch.randn(20_000, generator=gen(1))
    args = dict(weight=[None, 1.0], density=[None, 0.2])
    first = run("dare_linear", [torch.zeros_like(x), x], generator=gen(2), **args)
    assert first.abs().sum().item() == pytest.approx(x.abs().sum().item(), rel=1e-5)
    assert (first != 0).float().mean().item() == pytest.approx(0.2, abs=0.01)
    assert torch.equal(first, run("dare_linear", [torch.zeros_like(x), x], generator=gen(2), **args))
    assert not torch.equal(first, run("dare_linear", [torch.zeros_like(x), x], generator=gen(3), **args))


def test_dare_ties_at_density_one_is_ties_consensus_without_normalize():
    # sums [-2,-2] -> both -; entry 0: only -3 agrees; entry 1: -1 + -1 (no normalize by default)
    out = run("dare_ties", [[0.0, 0.0], [1.0, -1.0], [-3.0, -1.0]], generator=gen(), weight=[None, 1.0, 1.0])
    assert close(out, [-3.0, -2.0])


def test_della_bad_epsilon_names_the_parameter_and_defaults_are_mergekits():
    with pytest.raises(InvalidParameterError) as info:
        run("della", [[0.0] * 4, [1.0] * 4], generator=gen(), weight=[None, 1.0], density=[None, 0.9])
    assert info.value.param == "epsilon"  # 0.9 + the default 0.15 >= 1
    out = run("della", [[0.0] * 4, [1.0, 2.0, 3.0, 4.0]], generator=gen(), weight=[None, 1.0])
    assert close(out, [1.0, 2.0, 3.0, 4.0])  # density defaults to 1: nothing pruned


def test_della_linear_seeded_pruning_by_rank():
    x = torch.tensor([0.1, -0.4, 0.3, 0.2])
    # ascending ranks 0, 3, 2, 1 of 4: p = 0.3 + 0.4 * r / 3
    probability = torch.tensor([0.3, 0.7, 0.3 + 0.8 / 3, 0.3 + 0.4 / 3])
    expected = x * (torch.rand(4, generator=gen(11)) < probability)
    out = run(
        "della_linear",
        [torch.zeros(4), x],
        generator=gen(11),
        weight=[None, 1.0],
        density=[None, 0.5],
        epsilon=[None, 0.2],
        rescale=False,
    )
    assert torch.equal(out, expected)


# --- sce, ram ----------------------------------------------------------------------------------------------------


def test_sce_weights_by_energy_and_erases_minority_signs():
    # task vectors a = [1, 2], b = [3, -2]: energies 2.5 and 6.5 -> weights 2.5/9, 6.5/9
    # sums [4, 0] elect [+, +]; entry 0: (1*2.5 + 3*6.5)/9 / (9/9) = 22/9; entry 1: only a agrees -> 2
    assert close(run("sce", [[0.0, 0.0], [1.0, 2.0], [3.0, -2.0]]), [22 / 9, 2.0])


def test_sce_select_topk_keeps_the_highest_variance_entries():
    # variances over models: entry 0 (1, 3) -> 1, entry 1 (2, -2) -> 4; k = int(2 * 0.5) = 1 keeps entry 1
    # then a = [0, 2], b = [0, -2]: equal weights, sum 0 elects +, a alone -> 2; entry 0 has no votes -> 0
    assert close(run("sce", [[0.0, 0.0], [1.0, 2.0], [3.0, -2.0]], select_topk=0.5), [0.0, 2.0])
    assert close(run("sce", [[1.0, 1.0], [1.0, 2.0], [3.0, -2.0]], select_topk=0.0), [1.0, 1.0])


def test_sce_identical_models_give_the_base():
    assert close(run("sce", [[1.0, -1.0], [1.0, -1.0], [1.0, -1.0]], select_topk=0.5), [1.0, -1.0])


def test_ram_unique_changes_stay_shared_ones_are_averaged():
    # changes a = [1, 0, 2, 1e-6], b = [3, 0, 0, 0]; 1e-6 is below epsilon 1e-5 and does not count
    # entry 0: shared -> (1 + 3)/2; entry 2: a's alone -> 2
    tensors = [[0.0] * 4, [1.0, 0.0, 2.0, 1e-6], [3.0, 0.0, 0.0, 0.0]]
    assert close(run("ram", tensors), [2.0, 0.0, 2.0, 0.0])


def test_ramplus_scales_unique_changes_by_the_shared_to_unique_ratio():
    # a: 1 shared, 1 unique -> rho 1, capped at alpha 0.4 -> lambda 1 + 0.5 * 0.4 = 1.2 on its unique change 2
    tensors = [[0.0] * 4, [1.0, 0.0, 2.0, 1e-6], [3.0, 0.0, 0.0, 0.0]]
    assert close(run("ramplus_tl", tensors, r=0.5, alpha=0.4), [2.0, 0.0, 2.4, 0.0])


# --- slerp family -----------------------------------------------------------------------------------------------


def test_slerp_method_orthogonal_parallel_and_antiparallel():
    assert close(run("slerp", [[1.0, 0.0], [0.0, 1.0]], t=0.5), [R2, R2])
    assert close(run("slerp", [[1.0, 2.0], [2.0, 4.0]], t=0.25), [1.25, 2.5])  # parallel: lerp
    assert close(run("slerp", [[1.0, 1.0], [-3.0, -3.0]], t=0.5), [-1.0, -1.0])  # antiparallel: lerp
    assert close(run("slerp", [[0.0, 1.0], [1.0, 0.0]], 1, t=0.0), [1.0, 0.0])  # t = 0 is the base


def test_nuslerp_takes_t_from_the_weights():
    # weights 1 and 3: t = 0.75; orthogonal unit vectors: sin(0.25 * pi/2), sin(0.75 * pi/2)
    out = run("nuslerp", [[1.0, 0.0], [0.0, 1.0]], None, weight=[1.0, 3.0])
    assert close(out, [math.sin(math.pi / 8), math.sin(3 * math.pi / 8)])
    assert close(run("nuslerp", [[1.0, 0.0], [0.0, 1.0]], None, weight=[1.0, -1.0]), [R2, R2])  # sum 0: t = 0.5


def test_nuslerp_with_a_base_interpolates_task_vectors():
    # task vectors [1,0] and [0,1] from base [1,1]
    out = run("nuslerp", [[1.0, 1.0], [2.0, 1.0], [1.0, 2.0]], 0, weight=[None, 1.0, 1.0])
    assert close(out, [1 + R2, 1 + R2])


def test_nuslerp_antiparallel_is_linear():
    assert close(run("nuslerp", [[1.0, 0.0], [-2.0, 0.0]], None, weight=[1.0, 1.0]), [-0.5, 0.0])


def test_nuslerp_rows_and_columns():
    v0, v1 = [[1.0, 0.0], [1.0, 0.0]], [[0.0, 1.0], [2.0, 0.0]]
    # row 0 orthogonal -> [R2, R2]; row 1 parallel -> lerp [1.5, 0]
    rows = run("nuslerp", [v0, v1], None, weight=[1.0, 1.0], nuslerp_flatten=False)
    assert close(rows, [[R2, R2], [1.5, 0.0]])
    columns = run(
        "nuslerp",
        [torch.tensor(v0).T, torch.tensor(v1).T],
        None,
        weight=[1.0, 1.0],
        nuslerp_flatten=False,
        nuslerp_row_wise=True,
    )
    assert close(columns, [[R2, 1.5], [R2, 0.0]])


def test_multislerp_of_orthogonal_vectors_and_a_single_model():
    assert close(run("multislerp", [[2.0, 0.0], [0.0, 2.0]], None, weight=[1.0, 1.0]), [2 * R2, 2 * R2])
    # with a base, the mean norm of the task vectors (1 and 3, weights 0.5 each) scales the direction
    out = run("multislerp", [[1.0, 1.0], [2.0, 1.0], [1.0, 4.0]], 0, weight=[None, 1.0, 1.0])
    assert close(out, [1 + 2 * R2, 1 + 2 * R2], atol=1e-5)
    assert close(run("multislerp", [[1.0, 1.0], [5.0, -2.0]], 0, weight=[None, 0.3]), [5.0, -2.0])


def test_multislerp_antipodal_pair_falls_back_to_linear_and_a_balanced_triple_is_refused():
    assert close(run("multislerp", [[1.0, 2.0], [-1.0, -2.0]], None, weight=[1.0, 1.0]), [0.0, 0.0])
    with pytest.raises(InvalidParameterError) as info:
        run("multislerp", [[1.0, 2.0], [-1.0, -2.0], [1.0, 2.0]], None, weight=[0.25, 0.5, 0.25])
    assert info.value.param == "weight"


def test_karcher_mean_of_orthogonal_and_symmetric_vectors():
    # unit directions [1,0], [0,1]: mean direction [R2, R2], scaled by the mean norm (2 + 4) / 2 = 3
    assert close(run("karcher", [[2.0, 0.0], [0.0, 4.0]], None), [3 * R2, 3 * R2], atol=1e-5)
    third = 1 / math.sqrt(3)
    out = run("karcher", [[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]], None)
    assert close(out, [third, third, third], atol=1e-5)


def test_karcher_single_identical_and_zero_inputs():
    assert close(run("karcher", [[3.0, -4.0]], None), [3.0, -4.0])
    assert close(run("karcher", [[3.0, -4.0], [3.0, -4.0]], None), [3.0, -4.0], atol=1e-5)
    assert close(run("karcher", [[0.0, 0.0], [0.0, 0.0]], None), [0.0, 0.0])
    # a zero input adds no direction but still counts in the mean norm: direction [1, 0], norm (2 + 0) / 2
    assert close(run("karcher", [[2.0, 0.0], [0.0, 0.0]], None), [1.0, 0.0])


# --- model stock, nearswap, arcee fusion, passthrough -----------------------------------------------------------


def test_model_stock_factor_from_the_angle():
    # offsets [1,0] and [0.5, sqrt(0.75)]: cos 0.5, N = 2 -> t = 2 * 0.5 / (1 + 0.5) = 2/3
    b = math.sqrt(0.75)
    out = run("model_stock", [[1.0, 1.0], [2.0, 1.0], [1.5, 1.0 + b]])
    average_offset = [0.75, b / 2]
    assert close(out, [1 + 2 / 3 * average_offset[0], 1 + 2 / 3 * average_offset[1]])


def test_model_stock_parallel_orthogonal_and_opposite_offsets():
    assert close(run("model_stock", [[0.0, 0.0], [1.0, 0.0], [3.0, 0.0]]), [2.0, 0.0])  # cos 1: t = 1, the average
    assert close(run("model_stock", [[0.0, 0.0], [1.0, 0.0], [0.0, 1.0]]), [0.0, 0.0])  # cos 0: t = 0, the base
    assert close(run("model_stock", [[5.0, 5.0], [6.0, 5.0], [4.0, 5.0]]), [5.0, 5.0])  # 1 + cos = 0: the base


def test_model_stock_filter_wise_has_one_factor_per_row():
    # row 0 offsets parallel (t = 1, average [2, 0]), row 1 orthogonal (t = 0, base)
    out = run(
        "model_stock", [[[0.0, 0.0], [1.0, 1.0]], [[1.0, 0.0], [2.0, 1.0]], [[3.0, 0.0], [1.0, 2.0]]], filter_wise=True
    )
    assert close(out, [[2.0, 0.0], [1.0, 1.0]])


def test_model_stock_identical_models_give_the_base():
    assert close(run("model_stock", [[1.0, 2.0], [1.0, 2.0], [1.0, 2.0]]), [1.0, 2.0])


def test_nearswap_swaps_close_entries_and_moves_far_ones_less():
    # |diff| 0.05, 0.2, 1 with t 0.1: weights min(1, 0.1/|diff|) = 1, 0.5, 0.1
    out = run("nearswap", [[0.0, 0.0, 0.0], [0.05, 0.2, -1.0]], t=0.1)
    assert close(out, [0.05, 0.1, -0.1])
    assert close(run("nearswap", [[1.0, 2.0], [1.0, 2.0]], t=0.1), [1.0, 2.0])


def test_arcee_fusion_takes_the_important_changes():
    g = gen(3)
    base = torch.randn(3, 40, generator=g)
    other = base + 0.1 * torch.randn(3, 40, generator=g)
    p, q = torch.softmax(other, -1) + 1e-8, torch.softmax(base, -1) + 1e-8
    importance = (other - base).abs() * (p * (p / q).log()).sum(-1, keepdim=True)
    ordered = sorted(importance.reshape(-1).tolist())
    q1, median, q3 = (ordered[int(q * 119)] for q in (0.25, 0.5, 0.75))  # 120 entries: indices 29, 59, 89
    expected = torch.where(importance >= median + 1.5 * (q3 - q1), other, base)
    out = run("arcee_fusion", [base, other])
    assert torch.allclose(out, expected, atol=1e-6) and 0 < (out != base).sum() < 120


def test_arcee_fusion_of_identical_models_is_the_base():
    assert close(run("arcee_fusion", [[1.0, 2.0, 3.0], [1.0, 2.0, 3.0]]), [1.0, 2.0, 3.0])


def test_passthrough_scales_or_copies():
    assert close(run("passthrough", [[1.0, -2.0]], None, scale=[2.0]), [2.0, -4.0])
    source = torch.tensor([1.0, -2.0])
    out = get_method("passthrough").kernel([source], None, {}, [{"scale": None}], None)
    assert torch.equal(out, source) and out.data_ptr() != source.data_ptr()
