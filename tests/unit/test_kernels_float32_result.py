"""arcee_fusion and ramplus_tl in a recipe's half dtype: computed in it op for op as mergekit 0.1.5 does, with a
float32 mask or scale that makes the result float32, which a mergekit recipe without ``out_dtype`` writes as it
is (MethodSpec.float32_result). Tensors small enough to compute by hand."""

from __future__ import annotations

import torch

from alloy.merge.executor import merge_state_dicts
from alloy.merge.mergekit import load_recipe_yaml
from kernels import arcee_fusion
from kernels.registry import METHODS, get_method

NAME = "model.layers.0.mlp.up_proj.weight"
BF16 = torch.bfloat16


def test_the_methods_whose_mergekit_result_is_float32_declare_it():
    assert {name for name, spec in METHODS.items() if spec.float32_result} == {"arcee_fusion", "ramplus_tl"}
    assert all(spec.computes_in_dtype for spec in METHODS.values() if spec.float32_result)


def test_arcee_threshold_rounds_in_the_scores_dtype():
    # sorted scores [0, 127.5, 128, 129, 130]: q1 = 127.5, median = 128, q3 = 129 (indices 1, 2, 3);
    # 128 + 1.5 * 1.5 = 130.25, which bfloat16 rounds to 130 (its step is 1 there): 130 reaches it only in bfloat16
    scores = torch.tensor([130.0, 0.0, 129.0, 127.5, 128.0])
    assert arcee_fusion.threshold(scores).item() == 130.25
    half = arcee_fusion.threshold(scores.to(BF16))
    assert half.dtype == BF16 and half.item() == 130.0


def test_arcee_fusion_in_bfloat16_rounds_the_change_and_returns_float32():
    # one entry per row: softmax is 1, the KL divergence 0, every importance 0 = the threshold, so every change
    # is taken. The change 256 - 1.0078125 = 254.9921875 rounds to 255 in bfloat16; plus the base in float32
    base = torch.tensor([[1.0078125], [2.0]], dtype=BF16)
    other = torch.tensor([[256.0], [3.0]], dtype=BF16)
    kernel = get_method("arcee_fusion").kernel
    out = kernel([base, other], 0, {}, [{}, {}], None, dtype=BF16)
    assert out.dtype == torch.float32 and out.flatten().tolist() == [256.0078125, 3.0]
    exact = kernel([base.float(), other.float()], 0, {}, [{}, {}], None)  # the float32 path: the exact change
    assert exact.dtype == torch.float32 and exact.flatten().tolist() == [256.0, 3.0]


def _ramplus(models, dtype=None, r=0.1, alpha=1.0):
    options = {} if dtype is None else {"dtype": dtype}
    shared = {"r": r, "alpha": alpha, "epsilon": 1e-5}
    return get_method("ramplus_tl").kernel(models, 0, shared, [{}] * len(models), None, **options)


def test_ramplus_in_bfloat16_scales_by_a_float32_factor_and_returns_float32():
    # model a changes entries 0, 1, 2; model b entry 2 only. a: 2 unique, 1 shared, rho = 0.5, scale =
    # 1 + float32(0.1) * 0.5 = float32(1.05); b has no unique change. Entry 2 is the mean 0.5 + 1 = 1.5.
    base = torch.zeros(4, dtype=BF16)
    a = torch.tensor([1.0, 3.0, 1.0, 0.0], dtype=BF16)
    b = torch.tensor([0.0, 0.0, 2.0, 0.0], dtype=BF16)
    scale = torch.tensor(1.0) + torch.tensor(0.1) * 0.5  # float32 maths
    out = _ramplus([base, a, b], BF16)
    assert out.dtype == torch.float32
    assert out.tolist() == [scale.item(), (3 * scale).item(), 1.5, 0.0]
    assert scale.item() != torch.tensor(1.05, dtype=BF16).item()  # what a bfloat16 result would hold


def test_ramplus_with_only_the_base_returns_it():
    base = torch.ones(3, dtype=BF16)
    out = _ramplus([base], BF16)
    assert out.dtype == BF16 and torch.equal(out, base)


def _merge(method: str, tail: str) -> dict[str, torch.Tensor]:
    text = f"merge_method: {method}\nbase_model: base\nmodels: [{{model: base}}, {{model: a}}]\n{tail}"
    state = {
        "base": {NAME: torch.tensor([[1.0078125, 0.0]], dtype=BF16)},
        "a": {NAME: torch.tensor([[256.0, 2.0]], dtype=BF16)},
    }
    return merge_state_dicts(load_recipe_yaml(text), state)


def test_a_mergekit_recipe_writes_the_float32_result_unless_out_dtype_casts_it():
    for method in ("arcee_fusion", "ramplus_tl"):
        assert _merge(method, "dtype: bfloat16\n")[NAME].dtype == torch.float32, method
        assert _merge(method, "")[NAME].dtype == torch.float32, method  # computed in the inputs' bfloat16
        assert _merge(method, "dtype: bfloat16\nout_dtype: bfloat16\n")[NAME].dtype == BF16, method
        assert _merge(method, "dtype: float32\nout_dtype: float16\n")[NAME].dtype == torch.float16, method
    # the other methods write the compute dtype, as mergekit's do
    assert _merge("ram", "dtype: bfloat16\n")[NAME].dtype == BF16
