"""Recipe forms over the output-slice plan: parameter precedence (slice source > output slice > model > global),
partial depth, several slices, passthrough scale, and models with several layer stacks (no model files: plans are
built from synthetic layouts)."""

from __future__ import annotations

import pytest
import torch

from alloy.errors import AlloyError, ErrorCode
from alloy.merge.mergekit import load_recipe_yaml
from alloy.merge.plan import TensorMeta, build_plan, output_config
from alloy.merge.recipe import MergeRecipe, ModelRef, validate_recipe
from alloy.merge.tensor_merge import resolve_task_parameters
from tests.unit.test_merge_recipe import layout, plan_of, task


def test_slice_parameters_beat_global_ones():
    plan = plan_of(
        """
merge_method: slerp
base_model: A
slices:
  - sources: [{model: A, layer_range: [0, 2]}, {model: B, layer_range: [0, 2]}]
    parameters: {t: 0.3}
parameters: {t: 0.9}
""",
        {"A": 2, "B": 2},
    )
    shared, _ = resolve_task_parameters(plan, task(plan, "model.layers.1.mlp.up_proj.weight"))
    assert shared["t"] == 0.3


def test_parameter_precedence_source_slice_model_global():
    text = """
merge_method: task_arithmetic
base_model: A
slices:
  - sources:
      - {model: A, layer_range: [0, 2]}
      - {model: B, layer_range: [0, 2], parameters: {weight: 0.1}}
      - {model: C, layer_range: [0, 2]}
    parameters: {weight: 0.2, lambda: 0.7}
parameters: {weight: 0.3, lambda: 0.5}
"""
    plan = plan_of(text, {"A": 2, "B": 2, "C": 2})
    shared, inputs = resolve_task_parameters(plan, task(plan, "model.layers.0.mlp.up_proj.weight"))
    assert shared["lambda"] == 0.7
    assert [p["weight"] for p in inputs[1:]] == [0.1, 0.2]


def test_model_level_sits_between_slice_and_global_in_alloy_recipes():
    validated = validate_recipe(
        MergeRecipe(
            strategy="task_arithmetic",
            models=[
                ModelRef(model="a"),
                ModelRef(model="b", parameters={"weight": 0.4}),
                ModelRef(model="c", parameters={"weight": 0.4}),
            ],
            parameters={"weight": 0.9},
            slices=[
                {
                    "sources": [
                        {"model": "a", "layer_range": [0, 2]},
                        {"model": "b", "layer_range": [0, 2]},
                        {"model": "c", "layer_range": [0, 2], "parameters": {"weight": 0.2}},
                    ]
                }
            ],
        )
    )
    plan = build_plan(validated, {m: layout(2) for m in "abc"})
    _, inputs = resolve_task_parameters(plan, task(plan, "model.layers.0.mlp.up_proj.weight"))
    assert [p["weight"] for p in inputs[1:]] == [0.4, 0.2]


def test_a_filter_that_matches_nothing_falls_through_to_the_next_level():
    plan = plan_of(
        """
merge_method: slerp
base_model: A
slices:
  - sources: [{model: A, layer_range: [0, 3]}, {model: B, layer_range: [0, 3]}]
    parameters: {t: [{filter: self_attn, value: [0.0, 1.0]}]}
parameters: {t: 0.25}
""",
        {"A": 3, "B": 3},
    )
    attn = [
        resolve_task_parameters(plan, task(plan, f"model.layers.{i}.self_attn.q_proj.weight"))[0]["t"] for i in range(3)
    ]
    mlp = resolve_task_parameters(plan, task(plan, "model.layers.1.mlp.up_proj.weight"))[0]["t"]
    assert attn == [0.0, 0.5, 1.0] and mlp == 0.25


def test_partial_layer_range_writes_only_those_layers():
    plan = plan_of(
        """
merge_method: slerp
base_model: A
slices:
  - sources: [{model: A, layer_range: [0, 3]}, {model: B, layer_range: [0, 3]}]
parameters: {t: 0.5}
""",
        {"A": 5, "B": 5},
    )
    layers = {t.output_name.split(".")[2] for t in plan.tasks if t.output_name.startswith("model.layers.")}
    assert layers == {"0", "1", "2"} and plan.output_layers == 3
    config = output_config(plan, {"num_hidden_layers": 5, "layer_types": ["full", "sliding"] * 2 + ["full"]})
    assert config["num_hidden_layers"] == 3 and config["layer_types"] == ["full", "sliding", "full"]


def test_several_slices_each_with_their_own_sources_ranges_and_t():
    plan = plan_of(
        """
merge_method: slerp
base_model: A
slices:
  - sources: [{model: A, layer_range: [0, 2]}, {model: B, layer_range: [0, 2]}]
    parameters: {t: [0.0, 1.0]}
  - sources: [{model: A, layer_range: [3, 4]}, {model: B, layer_range: [2, 3]}]
    parameters: {t: 0.7}
""",
        {"A": 4, "B": 4},
    )
    last = task(plan, "model.layers.2.mlp.up_proj.weight")
    assert last.sources == (("A", "model.layers.3.mlp.up_proj.weight"), ("B", "model.layers.2.mlp.up_proj.weight"))
    ts = [resolve_task_parameters(plan, task(plan, f"model.layers.{i}.mlp.up_proj.weight"))[0]["t"] for i in range(3)]
    assert ts == [0.0, 1.0, 0.7] and plan.output_layers == 3
    # embeddings from the first slice's sources, final norm and LM head from the last's, both at t = 0
    assert task(plan, "lm_head.weight").slice_index == 1 and task(plan, "lm_head.weight").depth == 0.0


def test_mergekit_passthrough_is_franken_merge_with_one_source_per_slice():
    loaded = validate_recipe(
        load_recipe_yaml("""
merge_method: passthrough
slices:
  - sources: [{model: A, layer_range: [0, 3]}]
  - sources: [{model: B, layer_range: [2, 4]}]
""")
    )
    assert (loaded.strategy, loaded.variant) == ("franken_merge", "passthrough")
    assert [m.model for m in loaded.models] == ["A", "B"]


def test_passthrough_scale_resolves_at_every_level():
    plan = plan_of(
        """
merge_method: passthrough
slices:
  - sources: [{model: A, layer_range: [0, 1], parameters: {scale: 0.5}}]
  - sources: [{model: A, layer_range: [1, 2]}]
    parameters: {scale: [{filter: mlp, value: 2.0}]}
parameters: {scale: 3.0}
""",
        {"A": 2},
    )
    scale = lambda name: resolve_task_parameters(plan, task(plan, name))[1][0]["scale"]  # noqa: E731
    assert scale("model.layers.0.mlp.up_proj.weight") == 0.5
    assert scale("model.layers.1.mlp.up_proj.weight") == 2.0
    assert scale("model.layers.1.self_attn.q_proj.weight") == 3.0


def two_stacks() -> dict[str, TensorMeta]:
    """A multimodal layout: a 2-layer vision tower and a 3-layer language model."""
    meta = TensorMeta((4, 4), torch.float32)
    names = ["language_model.model.embed_tokens.weight", "multi_modal_projector.linear_1.weight"]
    names += [f"vision_tower.transformer.layers.{i}.attention.q_proj.weight" for i in range(2)]
    names += [f"language_model.model.layers.{i}.self_attn.q_proj.weight" for i in range(3)]
    return {n: meta for n in names}


def test_each_layer_stack_has_its_own_depth():
    recipe = validate_recipe(
        load_recipe_yaml(
            "merge_method: slerp\nbase_model: A\nmodels: [{model: A}, {model: B}]\nparameters: {t: [0.0, 1.0]}\n"
        )
    )
    plan = build_plan(recipe, {"A": two_stacks(), "B": two_stacks()})
    t = lambda name: resolve_task_parameters(plan, task(plan, name))[0]["t"]  # noqa: E731
    assert t("vision_tower.transformer.layers.1.attention.q_proj.weight") == 1.0
    assert t("language_model.model.layers.1.self_attn.q_proj.weight") == 0.5
    assert plan.output_layers is None  # the config keeps its layer counts


def test_slicing_a_model_with_several_layer_stacks_is_refused():
    recipe = validate_recipe(
        load_recipe_yaml("merge_method: passthrough\nslices: [{sources: [{model: A, layer_range: [0, 2]}]}]\n")
    )
    with pytest.raises(AlloyError) as info:
        build_plan(recipe, {"A": two_stacks()})
    assert info.value.code is ErrorCode.VALIDATION_FAILED and info.value.details["field"] == "slices"
