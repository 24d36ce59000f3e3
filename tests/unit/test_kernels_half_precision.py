"""Task arithmetic and TIES computed in a recipe's bfloat16 / float16, op for op as mergekit 0.1.5 does, on tensors
small enough to compute by hand; and the rule that picks the compute dtype (recipe layer)."""

from __future__ import annotations

import pytest
import torch

from alloy.merge.executor import merge_state_dicts
from alloy.merge.mergekit import load_recipe_yaml
from alloy.merge.recipe import MergeRecipe, ModelRef
from kernels.gta_reduced import agreement, generalized_task_arithmetic_in
from kernels.registry import METHODS, get_method

NAME = "model.layers.0.mlp.up_proj.weight"
SHARED = {"lambda": 1.0, "normalize": False, "rescale": False, "int8_mask": False}


def _ties(tensors, dtype=None, **shared):
    params = [{"weight": 1.0, "density": 0.5}] * len(tensors)
    options = {} if dtype is None else {"dtype": dtype}
    return get_method("ties").kernel(tensors, 0, {**SHARED, **shared}, params, None, **options)


def test_bfloat16_ties_ranks_the_rounded_task_vectors():
    # base [1, 0], model [512, 512]: float32 task vector [511, 512] keeps entry 1 (k = 1); in bfloat16 511 rounds
    # to 512, the two magnitudes tie, and the first by position is kept: the base's 1 + 512 rounds to 512
    base, model = torch.tensor([1.0, 0.0]), torch.tensor([512.0, 512.0])
    assert _ties([base, model]).tolist() == [1.0, 512.0]
    out = _ties([base.bfloat16(), model.bfloat16()], torch.bfloat16)
    assert out.dtype == torch.bfloat16 and out.tolist() == [512.0, 0.0]


def test_bfloat16_weights_are_rounded_like_mergekits_weight_tensor():
    # 3 * 0.6: mergekit multiplies by bfloat16(0.6) = 0.6015625, giving 1.8046875 (exact in bfloat16); computing
    # in float32 and rounding after gives bfloat16(1.8) = 1.796875
    base, model = torch.zeros(1), torch.full((1,), 3.0)
    spec = get_method("task_arithmetic")
    shared = {**SHARED, "lambda": 1.0}
    half = spec.kernel(
        [base.bfloat16(), model.bfloat16()], 0, shared, [{}, {"weight": 0.6}], None, dtype=torch.bfloat16
    )
    assert half.item() == 1.8046875
    assert spec.kernel([base, model], 0, shared, [{}, {"weight": 0.6}], None).bfloat16().item() == 1.796875


def test_sign_consensus_and_normalized_divisor_in_bfloat16():
    # weighted deltas a = 0.5 * [2, -2, 1], b = 1.5 * [-2, 2, 1]: sums [-2, 2, 2] elect [-, +, +];
    # agreeing: [b, b, a+b]; divisors [1.5, 1.5, 2]: [-3/1.5, 3/1.5, 2/2] = [-2, 2, 1]
    base = torch.zeros(3, dtype=torch.bfloat16)
    a = torch.tensor([2.0, -2.0, 1.0], dtype=torch.bfloat16)
    b = torch.tensor([-2.0, 2.0, 1.0], dtype=torch.bfloat16)
    params = [{"weight": 0.5}, {"weight": 1.5}]
    out = generalized_task_arithmetic_in(
        torch.bfloat16, base, [a, b], params, prune=None, consensus=True, normalize=True, rescale=False, lam=1.0
    )
    assert out.tolist() == [-2.0, 2.0, 1.0]


def test_agreement_counts_zero_sums_as_positive_and_zeros_never_agree():
    stacked = torch.tensor([[1.0, 0.0, -1.0], [-1.0, 0.0, -2.0]], dtype=torch.float16)
    assert agreement(stacked).tolist() == [[True, False, True], [False, False, True]]


def test_reduced_path_does_not_modify_its_inputs_and_refuses_float32():
    base, model = torch.zeros(4, dtype=torch.bfloat16), torch.ones(4, dtype=torch.bfloat16)
    copies = base.clone(), model.clone()
    generalized_task_arithmetic_in(
        torch.bfloat16,
        base,
        [model],
        [{"weight": 1.0}],
        prune=None,
        consensus=False,
        normalize=True,
        rescale=False,
        lam=2.0,
    )
    assert torch.equal(base, copies[0]) and torch.equal(model, copies[1])
    with pytest.raises(ValueError):
        generalized_task_arithmetic_in(
            torch.float32, base, [model], [{}], prune=None, consensus=False, normalize=False, rescale=False, lam=1.0
        )


def test_the_methods_mergekit_computes_in_the_recipes_dtype_declare_it():
    native = {name for name, spec in METHODS.items() if spec.computes_in_dtype}
    gta = {"task_arithmetic", "ties", "dare_linear", "dare_ties", "breadcrumbs", "breadcrumbs_ties", "della"}
    others = {"nuslerp", "multislerp", "model_stock", "nearswap", "ram", "sce", "karcher", "arcee_fusion", "ramplus_tl"}
    assert gta | {"della_linear"} | others == native


# --- the compute dtype rule (alloy.merge.tensor_merge.compute_dtype) ---------------------------------------------


def _merge(text: str, dtype=torch.float32):
    state = {"base": {NAME: torch.zeros(1, 1, dtype=dtype)}, "a": {NAME: torch.full((1, 1), 3.0, dtype=dtype)}}
    return merge_state_dicts(load_recipe_yaml(text), state)[NAME]


RECIPE = "merge_method: task_arithmetic\nbase_model: base\nmodels: [{model: a, parameters: {weight: 0.6}}]\n"


def test_a_mergekit_recipes_dtype_is_its_compute_dtype_and_out_dtype_only_the_output():
    assert _merge(RECIPE + "dtype: bfloat16\n").item() == 1.8046875
    out = _merge(RECIPE + "dtype: bfloat16\nout_dtype: float32\n")
    assert out.dtype == torch.float32 and out.item() == 1.8046875
    out = _merge(RECIPE + "dtype: float32\nout_dtype: bfloat16\n")
    assert out.dtype == torch.bfloat16 and out.item() == 1.796875


def test_without_dtype_a_mergekit_recipe_computes_in_its_inputs_dtype_an_alloy_recipe_in_float32():
    assert _merge(RECIPE, torch.bfloat16).item() == 1.8046875
    native = MergeRecipe(
        strategy="task_arithmetic", base_model="base", models=[ModelRef(model="base"), ModelRef(model="a")]
    )
    state = {"base": {NAME: torch.zeros(1, 1).bfloat16()}, "a": {NAME: torch.full((1, 1), 3.0).bfloat16()}}
    native = native.model_copy(
        update={"models": [ModelRef(model="base"), ModelRef(model="a", parameters={"weight": 0.6})]}
    )
    assert merge_state_dicts(native, state)[NAME].item() == 1.796875


# --- every method that computes in the recipe's dtype ------------------------------------------------------------


def _family(dtype, count=3):
    g = torch.Generator().manual_seed(0)
    base = torch.randn(6, 5, generator=g)
    return [base] + [base + 0.1 * torch.randn(6, 5, generator=g) for _ in range(count - 1)]


def _contract_call(spec, tensors, **options):
    base_index = None if spec.base == "ignored" else 0
    shared = {p.name: p.default for p in spec.params if p.scope == "global"}
    if "t" in shared:
        shared["t"] = 0.3
    per_input = [
        {p.name: 0.5 if p.name in ("weight", "density") else p.default for p in spec.params if p.scope != "global"}
        for _ in tensors
    ]
    return spec.kernel(tensors, base_index, shared, per_input, torch.Generator().manual_seed(1), **options)


@pytest.mark.parametrize("method", sorted(n for n, s in METHODS.items() if s.computes_in_dtype))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_dtype_kernel_returns_that_dtype_and_leaves_its_inputs(method, dtype):
    spec = get_method(method)
    count = 3 if spec.max_models != 2 else 2
    tensors = [t.to(dtype) for t in _family(dtype, count)]
    copies = [t.clone() for t in tensors]
    out = _contract_call(spec, tensors, dtype=dtype)
    # a method whose mergekit result is float32 (a float32 mask or scale) returns float32
    assert (
        out.dtype == (torch.float32 if spec.float32_result else dtype)
        and out.shape == tensors[0].shape
        and torch.isfinite(out).all()
    )
    assert all(torch.equal(t, c) for t, c in zip(tensors, copies))


def test_nearswap_in_bfloat16_rounds_each_step():
    # |a - b| = 0.5, t = 0.1: weight = bf16(0.1 / 0.5) = bf16(0.2) = 0.2001953125; the result rounds
    # w * b + (1 - w) * a with b = 1.5, a = 1: bf16(0.30029296875) + bf16(0.7998046875) = 0.30078125 + 0.80078125
    base, other = torch.tensor([1.0], dtype=torch.bfloat16), torch.tensor([1.5], dtype=torch.bfloat16)
    out = get_method("nearswap").kernel([base, other], 0, {"t": 0.1}, [{}, {}], None, dtype=torch.bfloat16)
    weight = torch.tensor(0.2, dtype=torch.bfloat16).float()
    expected = (weight * 1.5).bfloat16().float() + (1 - weight).bfloat16().float()
    assert out.dtype == torch.bfloat16 and out.float().item() == expected.bfloat16().item()
