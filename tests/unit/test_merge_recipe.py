"""Recipe validation, request construction and the mergekit format (no model files: plans are built from
synthetic layouts)."""

from __future__ import annotations

import pytest
import torch

from alloy.errors import AlloyError, ErrorCode
from alloy.merge.mergekit import load_recipe_yaml
from alloy.merge.plan import TensorMeta, build_plan
from alloy.merge.recipe import MergeRecipe, ModelRef, validate_recipe
from alloy.merge.tensor_merge import resolve_task_parameters


def recipe(strategy="ties", models=("a", "b"), **kwargs) -> MergeRecipe:
    return MergeRecipe(strategy=strategy, models=[ModelRef(model=m) for m in models], **kwargs)


def layout(layers: int) -> dict[str, TensorMeta]:
    """A llama-like layout: embeddings, ``layers`` blocks of two tensors, final norm and LM head."""
    meta = TensorMeta((4, 4), torch.float32)
    names = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    names += [f"model.layers.{i}.{t}" for i in range(layers) for t in ("self_attn.q_proj.weight", "mlp.up_proj.weight")]
    return {n: meta for n in names}


def plan_of(text: str, layers: dict[str, int]):
    validated = validate_recipe(load_recipe_yaml(text))
    return build_plan(validated, {m: layout(n) for m, n in layers.items()})


def task(plan, name):
    return next(t for t in plan.tasks if t.output_name == name)


def refusal(text: str) -> AlloyError:
    with pytest.raises(AlloyError) as info:
        validate_recipe(load_recipe_yaml(text))
    return info.value


# --- Alloy-native recipes --------------------------------------------------------------------------------------


def test_unknown_strategy_is_invalid_strategy():
    with pytest.raises(AlloyError) as info:
        validate_recipe(recipe("magic"))
    assert info.value.code is ErrorCode.INVALID_STRATEGY


@pytest.mark.parametrize("strategy", ["linear", "dare_ties", "passthrough"])
def test_strategy_is_one_of_the_five_families(strategy):
    with pytest.raises(AlloyError) as info:
        validate_recipe(recipe(strategy))
    assert info.value.code is ErrorCode.INVALID_STRATEGY


def test_variant_must_belong_to_the_family():
    assert validate_recipe(recipe("task_arithmetic", variant="linear")).variant == "linear"
    with pytest.raises(AlloyError) as info:
        validate_recipe(recipe("ties", variant="dare_linear"))
    assert info.value.code is ErrorCode.INVALID_STRATEGY and info.value.details["field"] == "variant"


def test_bad_parameter_is_validation_failed_naming_it():
    with pytest.raises(AlloyError) as info:
        validate_recipe(recipe("ties", parameters={"density": 2}))
    assert info.value.code is ErrorCode.VALIDATION_FAILED
    assert info.value.details["parameter"] == "density" and info.value.details["field"] == "parameters.density"


@pytest.mark.parametrize("models", [("a",), tuple("abcdefghi")])
def test_model_count_is_two_to_eight(models):
    with pytest.raises(AlloyError) as info:
        validate_recipe(recipe("task_arithmetic", models))
    assert info.value.code is ErrorCode.VALIDATION_FAILED
    assert info.value.details["field"] == "models"


def test_slerp_takes_exactly_two_models():
    with pytest.raises(AlloyError) as info:
        validate_recipe(recipe("slerp", ("a", "b", "c"), parameters={"t": 0.5}))
    assert "slerp takes exactly 2 models, got 3" in info.value.message


def test_base_defaults_to_first_model_and_an_extra_base_joins_the_merge():
    assert recipe().base == "a"
    with_base = recipe(models=("x", "y"), base_model="b0")
    assert with_base.base == "b0" and with_base.model_ids == ["b0", "x", "y"]


def test_spec_spellings_pick_the_variant_and_become_mergekit_parameters():
    dare = validate_recipe(recipe("dare", ("a", "b", "c"), parameters={"drop_rate": 0.2, "consensus": True}))
    assert dare.variant == "dare_ties" and dare.parameters["density"] == pytest.approx(0.8)
    assert "drop_rate" not in dare.parameters and "consensus" not in dare.parameters
    della = validate_recipe(recipe("ties", ("a", "b", "c"), parameters={"density": 0.5, "epsilon": 0.1}))
    assert della.variant == "della" and della.parameters["epsilon"] == 0.1
    plain = validate_recipe(recipe("ties", ("a", "b"), parameters={"epsilon": 0.0, "scale": 0.5}))
    assert plain.variant == "ties" and "epsilon" not in plain.parameters and plain.parameters["lambda"] == 0.5
    with pytest.raises(AlloyError) as info:
        validate_recipe(recipe("ties", variant="ties", parameters={"epsilon": 0.1}))
    assert info.value.details["field"] == "parameters.epsilon"


def test_validation_is_idempotent():
    once = validate_recipe(recipe("dare", ("a", "b", "c"), parameters={"drop_rate": [0.1, 0.3]}))
    assert validate_recipe(once) == once
    assert once.parameters["density"] == [0.9, 0.7]


def test_from_request_fields():
    built = MergeRecipe.from_request_fields(
        models=["m1", "m2", "m3"],
        strategy="dare",
        parameters={"drop_rate": 0.2},
        output_model_id="out",
        model_parameters={"m2": {"weight": 0.5}},
        seed=9,
        dtype="bfloat16",
    )
    assert built.model_parameters("m2") == {"weight": 0.5}
    assert (built.seed, built.dtype, built.base) == (9, "bfloat16", "m1")
    validate_recipe(built)
    with pytest.raises(AlloyError) as info:
        MergeRecipe.from_request_fields(models=["m1", "m2"], strategy="ties", model_parameters={"zz": {}})
    assert info.value.details["field"] == "model_parameters"


def test_alloy_yaml_with_model_shorthand():
    loaded = load_recipe_yaml("strategy: slerp\nmodels: [a, b]\nparameters: {t: 0.3}\nseed: 4\n")
    assert loaded.strategy == "slerp" and [m.model for m in loaded.models] == ["a", "b"] and loaded.seed == 4


def test_alloy_yaml_takes_variant_and_mergekit_slices():
    loaded = validate_recipe(
        load_recipe_yaml("""
strategy: task_arithmetic
variant: linear
slices:
  - sources: [{model: a, layer_range: [0, 2], parameters: {weight: 2}}, {model: b, layer_range: [1, 3]}]
""")
    )
    assert loaded.variant == "linear" and loaded.slices[0].sources[0].parameters == {"weight": 2}


# --- mergekit recipes -------------------------------------------------------------------------------------------


def test_mergekit_dare_ties_keeps_mergekit_names_and_dtypes():
    loaded = validate_recipe(
        load_recipe_yaml("""
merge_method: dare_ties
base_model: base
models:
  - model: base
  - model: a
    parameters: {density: [0.6, 0.9], weight: 0.5}
parameters: {int8_mask: true, normalize: true}
dtype: bf16
out_dtype: float16
""")
    )
    assert (loaded.strategy, loaded.variant, loaded.base) == ("dare", "dare_ties", "base")
    assert (loaded.compute_dtype, loaded.dtype) == ("bfloat16", "float16")
    assert loaded.parameters == {"int8_mask": True, "normalize": True}
    assert loaded.model_parameters("a") == {"density": [0.6, 0.9], "weight": 0.5}


def test_mergekit_dtype_alone_is_the_compute_dtype_and_leaves_the_output_to_the_plan():
    # the plan writes the compute dtype, or float32 for a method whose mergekit result is float32
    loaded = load_recipe_yaml("merge_method: linear\nmodels: [{model: a}, {model: b}]\ndtype: float16\n")
    assert (loaded.compute_dtype, loaded.dtype) == ("float16", None)


def test_mergekit_keeps_mergekit_defaults_and_requires_weight():
    loaded = validate_recipe(load_recipe_yaml("merge_method: ties\nbase_model: b\nmodels: [{model: b}, {model: a}]\n"))
    plan = build_plan(loaded, {"a": layout(1), "b": layout(1)})
    with pytest.raises(AlloyError) as info:
        resolve_task_parameters(plan, plan.tasks[0])
    assert info.value.details["parameter"] == "weight"


def test_mergekit_methods_needing_a_base_refuse_a_recipe_without_one():
    error = refusal("merge_method: task_arithmetic\nmodels: [{model: a}, {model: b}]\nparameters: {weight: 1}\n")
    assert error.details["field"] == "base_model"
    error = refusal("""
merge_method: slerp
base_model: C
slices:
  - sources: [{model: A, layer_range: [0, 2]}, {model: B, layer_range: [0, 2]}]
parameters: {t: 0.5}
""")
    assert error.details["field"] == "base_model"


@pytest.mark.parametrize(
    "text, field",
    [
        ("merge_method: linear\nmodels: [{model: a}, {model: b}]\nname: x\n", "name"),
        ("merge_method: linear\nmodels: [{model: a}, {model: b}]\ntokenizer: {source: union, x: 1}\n", "tokenizer.x"),
        ("merge_method: linear\nmodels: [{model: a}, {model: b}]\nchat_template: alpaca\n", "chat_template"),
        ("merge_method: linear\nmodels: [{model: a, weight: 1}, {model: b}]\n", "models.0.weight"),
        ("merge_method: linear\nmodels: [{model: a+lora+more}, {model: b}]\n", "models.0.model"),  # one adapter at most
        (
            "merge_method: passthrough\nslices: [{sources: [{model: a, layer_range: [0, 1]}], residual_weight: 0.1}]\n",
            "slices.0.residual_weight",
        ),
        (
            "merge_method: linear\nmodels: [{model: a, parameters: {weight: 1, densty: 0.5}}, {model: b}]\n",
            "models.0.parameters.densty",  # no mergekit method knows it (density on linear: ignored, warned)
        ),
        (
            "merge_method: ties\nbase_model: a\nmodels: [{model: a}, {model: b, parameters: {normalize: true}}]\n",
            "models.1.parameters.normalize",
        ),
    ],
)
def test_every_key_is_honoured_or_refused_by_name(text, field):
    error = refusal(text)
    assert error.code is ErrorCode.VALIDATION_FAILED and error.details["field"] == field


@pytest.mark.parametrize(
    "text, code",
    [
        ("merge_method: frobnicate\nmodels: [{model: a}, {model: b}]\n", ErrorCode.INVALID_STRATEGY),
        ("just: [a, list]\n", ErrorCode.VALIDATION_FAILED),
        ("strategy: [unclosed\n", ErrorCode.VALIDATION_FAILED),
    ],
)
def test_unusable_recipe_files(text, code):
    with pytest.raises(AlloyError) as info:
        load_recipe_yaml(text)
    assert info.value.code is code


def test_mergekit_values_convert_as_mergekit_reads_them():
    loaded = validate_recipe(
        load_recipe_yaml("""
merge_method: karcher
models: [{model: a}, {model: b}]
parameters: {tol: 1e-5, max_iter: 12}
""")
    )
    assert loaded.parameters == {"tol": 1e-5, "max_iter": 12}
    ties = validate_recipe(
        load_recipe_yaml(
            "merge_method: ties\nbase_model: a\nmodels: [{model: a}, {model: b, "
            "parameters: {weight: 1, density: [{filter: mlp, value: '0.5'}]}}]\n"
            "parameters: {normalize: 0, int8_mask: 1.0}\n"
        )
    )
    assert ties.parameters == {"normalize": False, "int8_mask": True}
    assert ties.model_parameters("b")["density"] == [{"filter": "mlp", "value": 0.5}]


@pytest.mark.parametrize(
    "text, field",
    [
        ("strategy: ties\nmodels: [a, b]\nbogus: 1\n", "bogus"),
        ("strategy: ties\nmodels: [a, b]\nmergekit_config: 'x'\n", "mergekit_config"),
        (
            "strategy: ties\nslices: [{sources: [{model: a, layer_range: [0, 1], weight: 2}]}]\n",
            "slices.0.sources.0.weight",
        ),
    ],
)
def test_alloy_recipes_refuse_unknown_keys_by_name(text, field):
    with pytest.raises(AlloyError) as info:
        load_recipe_yaml(text)
    assert info.value.code is ErrorCode.VALIDATION_FAILED and info.value.details["field"] == field


def test_alloy_defaults_never_fill_a_parameter_of_another_meaning():
    # nearswap's t is a distance threshold (required), not slerp's interpolation factor
    recipe_ = validate_recipe(recipe("task_arithmetic", ("a", "b"), variant="nearswap"))
    assert "t" not in recipe_.parameters
    assert validate_recipe(recipe("slerp", ("a", "b"))).parameters["t"] == 0.5
