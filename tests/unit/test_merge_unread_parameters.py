"""Parameters a mergekit recipe sets that its method does not read: ignored as mergekit ignores them, with a warning
naming each, when mergekit knows the name; refused by name otherwise (and always in an Alloy-native recipe)."""

from __future__ import annotations

import pytest

from alloy.errors import AlloyError, ErrorCode
from alloy.merge.mergekit import load_recipe_yaml
from alloy.merge.recipe import MergeRecipe, ModelRef, validate_recipe
from alloy.merge.recipe_checks import MERGEKIT_PARAMETERS, ignored_warnings


def recipe(strategy, **kwargs) -> MergeRecipe:
    return MergeRecipe(strategy=strategy, models=[ModelRef(model="a"), ModelRef(model="b")], **kwargs)


def refusal(text: str) -> AlloyError:
    with pytest.raises(AlloyError) as info:
        validate_recipe(load_recipe_yaml(text))
    return info.value


def test_the_names_mergekit_knows_are_its_methods_parameters():
    assert {"weight", "density", "t", "epsilon", "gamma", "lambda", "select_topk", "scale"} <= MERGEKIT_PARAMETERS
    assert "densty" not in MERGEKIT_PARAMETERS


def test_slerp_weights_from_mergekits_basic_test_are_ignored_and_named():
    loaded = validate_recipe(
        load_recipe_yaml(
            "merge_method: slerp\nbase_model: a\nmodels:\n  - model: a\n    parameters: {weight: 0.6}\n"
            "  - model: b\n    parameters: {weight: 0.4}\nparameters: {t: 0.35}\n"
        )
    )
    assert loaded.ignored == ["models.0.parameters.weight", "models.1.parameters.weight"]
    assert all(ref.parameters == {} for ref in loaded.models)
    assert validate_recipe(loaded).ignored == loaded.ignored  # validating again adds nothing


def test_mergekit_ties_epsilon_is_ignored_as_mergekit_does_and_named_in_a_warning():
    # epsilon is a parameter mergekit knows (della reads it) and ties does not read: mergekit merges without it
    loaded = validate_recipe(
        load_recipe_yaml(
            "merge_method: ties\nbase_model: b\nmodels: [{model: b}, {model: a, parameters: {weight: 1, "
            "density: 0.5}}]\nparameters: {epsilon: 0.1}\n"
        )
    )
    assert loaded.ignored == ["parameters.epsilon"] and "epsilon" not in loaded.parameters
    assert ignored_warnings(loaded) == ["parameters.epsilon: not read by ties; ignored, as mergekit ignores it"]


@pytest.mark.parametrize(
    "level",
    ["parameters: {{{key}: 0.1}}\n", "models: [{{model: b}}, {{model: a, parameters: {{weight: 1, {key}: 0.1}}}}]\n"],
)
def test_a_parameter_name_mergekit_does_not_know_is_refused_by_name(level):
    models = "models: [{model: b}, {model: a, parameters: {weight: 1}}]\n" if level.startswith("parameters") else ""
    error = refusal("merge_method: ties\nbase_model: b\n" + models + level.format(key="epsilom"))
    assert error.code is ErrorCode.VALIDATION_FAILED and error.details["field"].endswith(".epsilom")


def test_an_alloy_recipe_never_ignores_a_parameter():
    with pytest.raises(AlloyError) as info:
        validate_recipe(recipe("slerp", parameters={"t": 0.5, "weight": 0.4}))
    assert info.value.code is ErrorCode.VALIDATION_FAILED and info.value.details["field"] == "parameters.weight"
