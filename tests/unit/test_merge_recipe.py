"""Recipe validation, request construction and the mergekit format."""

from __future__ import annotations

import pytest

from alloy.errors import AlloyError, ErrorCode
from alloy.merge.mergekit import load_recipe_yaml
from alloy.merge.recipe import MergeRecipe, ModelRef, validate_recipe


def recipe(strategy="ties", models=("a", "b"), **kwargs) -> MergeRecipe:
    return MergeRecipe(strategy=strategy, models=[ModelRef(model=m) for m in models], **kwargs)


def test_unknown_strategy_is_invalid_strategy():
    with pytest.raises(AlloyError) as info:
        validate_recipe(recipe("magic"))
    assert info.value.code is ErrorCode.INVALID_STRATEGY


def test_bad_parameter_is_validation_failed_naming_it():
    with pytest.raises(AlloyError) as info:
        validate_recipe(recipe("ties", parameters={"density": 2}))
    assert info.value.code is ErrorCode.VALIDATION_FAILED
    assert info.value.details["parameter"] == "density"


@pytest.mark.parametrize("models", [("a",), tuple("abcdefghi")])
def test_model_count_is_two_to_eight(models):
    with pytest.raises(AlloyError) as info:
        validate_recipe(recipe("task_arithmetic", models))
    assert info.value.code is ErrorCode.VALIDATION_FAILED
    assert info.value.details["field"] == "models"


def test_slerp_takes_exactly_two_models():
    with pytest.raises(AlloyError):
        validate_recipe(recipe("slerp", ("a", "b", "c")))


def test_base_defaults_to_first_model_and_an_extra_base_joins_the_merge():
    assert recipe().base == "a"
    with_base = recipe(models=("x", "y"), base_model="b0")
    assert with_base.base == "b0" and with_base.model_ids == ["b0", "x", "y"]


def test_from_request_fields():
    built = MergeRecipe.from_request_fields(
        models=["m1", "m2", "m3"], strategy="dare", parameters={"drop_rate": 0.2}, output_model_id="out",
        model_parameters={"m2": {"weight": 0.5}}, seed=9, dtype="bfloat16")
    assert built.model_parameters("m2") == {"weight": 0.5}
    assert (built.seed, built.dtype, built.base) == (9, "bfloat16", "m1")
    validate_recipe(built)
    with pytest.raises(AlloyError) as info:
        MergeRecipe.from_request_fields(models=["m1", "m2"], strategy="ties", model_parameters={"zz": {}})
    assert info.value.details["field"] == "model_parameters"


def test_alloy_yaml_with_model_shorthand():
    loaded = load_recipe_yaml("strategy: slerp\nmodels: [a, b]\nparameters: {t: 0.3}\nseed: 4\n")
    assert loaded.strategy == "slerp" and [m.model for m in loaded.models] == ["a", "b"] and loaded.seed == 4


def test_mergekit_dare_ties_maps_density_to_drop_rate():
    loaded = load_recipe_yaml("""
merge_method: dare_ties
base_model: base
models:
  - model: base
  - model: a
    parameters: {density: [0.6, 0.9], weight: 0.5}
parameters: {int8_mask: true, normalize: 1.0}
dtype: bf16
""")
    assert loaded.strategy == "dare" and loaded.base == "base" and loaded.dtype == "bfloat16"
    assert loaded.parameters == {"normalize": True, "consensus": True, "drop_rate": 0.0}
    assert loaded.model_parameters("a") == {"drop_rate": [0.4, 0.1], "weight": 0.5}
    validate_recipe(loaded)


def test_mergekit_slerp_with_one_full_slice_becomes_models():
    loaded = load_recipe_yaml("""
slices:
  - sources:
      - {model: A, layer_range: [0, 32]}
      - {model: B, layer_range: [0, 32]}
merge_method: slerp
base_model: A
parameters:
  t: [{filter: self_attn, value: [0, 1]}, {value: 0.5}]
""")
    assert [m.model for m in loaded.models] == ["A", "B"] and loaded.slices is None
    assert loaded.parameters["t"][1] == {"value": 0.5}
    validate_recipe(loaded)


def test_mergekit_passthrough_is_franken_merge():
    loaded = load_recipe_yaml("""
merge_method: passthrough
slices:
  - sources: [{model: A, layer_range: [0, 3]}]
  - sources: [{model: B, layer_range: [2, 4]}]
""")
    assert loaded.strategy == "franken_merge"
    assert [(s.model, s.layer_range) for s in loaded.slices] == [("A", (0, 3)), ("B", (2, 4))]
    assert [m.model for m in loaded.models] == ["A", "B"]
    validate_recipe(loaded)


def test_mergekit_ties_keeps_mergekit_density_default():
    loaded = load_recipe_yaml("merge_method: ties\nbase_model: b\nmodels: [{model: b}, {model: a}]\n")
    assert loaded.parameters["density"] == 1.0


@pytest.mark.parametrize("text, code", [
    ("merge_method: model_stock\nmodels: [{model: a}, {model: b}]\n", ErrorCode.INVALID_STRATEGY),
    ("just: [a, list]\n", ErrorCode.VALIDATION_FAILED),
    ("strategy: [unclosed\n", ErrorCode.VALIDATION_FAILED),
])
def test_unusable_recipe_files(text, code):
    with pytest.raises(AlloyError) as info:
        load_recipe_yaml(text)
    assert info.value.code is code


def test_slerp_model_count_error_says_exactly_two():
    from alloy.errors import AlloyError
    from alloy.merge.recipe import MergeRecipe, ModelRef, validate_recipe

    recipe = MergeRecipe(strategy="slerp", models=[ModelRef(model=m) for m in ("a", "b", "c")], parameters={"t": 0.5})
    with pytest.raises(AlloyError) as caught:
        validate_recipe(recipe)
    assert "slerp takes exactly 2 models (base model included), got 3" in caught.value.message
