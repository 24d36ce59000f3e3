"""Parameter forms (scalar, gradient, filter list) and the registry's validation."""

from __future__ import annotations

import pytest

from kernels.errors import InvalidParameterError, UnknownStrategyError
from kernels.params import depth_of, interpolate, layer_index, resolve_value
from kernels.registry import STRATEGIES, get_strategy, resolve_for_tensor, validate_parameters


def test_gradient_is_piecewise_linear_over_depth():
    points = [0.0, 1.0, 0.5]
    assert interpolate(points, 0.0) == 0.0
    assert interpolate(points, 0.25) == 0.5  # halfway between points 0 and 1
    assert interpolate(points, 0.5) == 1.0
    assert interpolate(points, 0.75) == 0.75  # halfway between 1.0 and 0.5
    assert interpolate(points, 1.0) == 0.5


def test_depth_follows_layer_index():
    assert layer_index("model.layers.3.self_attn.q_proj.weight") == 3
    assert layer_index("transformer.h.11.attn.c_attn.weight") == 11
    assert layer_index("model.embed_tokens.weight") is None
    # 5 layers: layer 3 is at t = 3/4; non-layer tensors at t = 0
    assert depth_of("model.layers.3.mlp.up_proj.weight", 5) == 0.75
    assert depth_of("lm_head.weight", 5) == 0.0


def test_filter_list_first_match_wins_and_values_may_be_gradients():
    value = [{"filter": "self_attn", "value": [0.0, 1.0]}, {"filter": "mlp", "value": 0.9}, {"value": 0.7}]
    assert resolve_value(value, "model.layers.1.self_attn.v_proj.weight", 0.25) == 0.25
    assert resolve_value(value, "model.layers.1.mlp.up_proj.weight", 0.25) == 0.9
    assert resolve_value(value, "model.norm.weight", 0.25) == 0.7
    assert resolve_value([{"filter": "mlp", "value": 0.9}], "model.norm.weight", 0.0) is None


def test_resolution_order_model_then_global_then_default():
    spec = get_strategy("ties")
    global_params, model_params = validate_parameters(
        spec, {"density": 0.4, "scale": 2.0}, [{}, {"weight": [{"filter": "self_attn", "value": 0.3}, {"value": 0.7}]}])
    assert global_params == {"density": 0.4, "lambda": 2.0}  # the alias is canonicalised
    resolved_global, resolved_models = resolve_for_tensor(
        spec, global_params, model_params, "model.layers.0.self_attn.q_proj.weight", 0.0)
    assert resolved_global == {"lambda": 2.0, "normalize": True}
    assert resolved_models[0] == {"density": 0.4, "epsilon": 0.0, "weight": 1.0}
    assert resolved_models[1] == {"density": 0.4, "epsilon": 0.0, "weight": 0.3}


def test_registry_declares_every_service_strategy():
    assert {"slerp", "ties", "dare", "task_arithmetic", "franken_merge", "linear"} <= set(STRATEGIES)
    t = get_strategy("slerp").param("t")
    assert (t.type, t.minimum, t.maximum, t.scope) == (float, 0.0, 1.0, "global")
    assert get_strategy("ties").param("density").scope == "per_model"


def test_unknown_strategy():
    with pytest.raises(UnknownStrategyError):
        get_strategy("average_vibes")


@pytest.mark.parametrize(
    ("strategy", "global_params", "model_params", "bad"),
    [
        ("slerp", {"t": 1.5}, [], "t"),
        ("slerp", {"t": [0.0, 2.0]}, [], "t"),  # every gradient point is range-checked
        ("ties", {"density": -0.1}, [], "density"),
        ("ties", {"densty": 0.5}, [], "densty"),
        ("dare", {"rescale": "yes"}, [], "rescale"),
        ("dare", {"drop_rate": [{"filter": "mlp", "value": 1.2}]}, [], "drop_rate"),
        ("task_arithmetic", {}, [{"lambda": 2.0}], "lambda"),  # global-only parameter given per model
        ("task_arithmetic", {"lambda": 1.0, "scale": 2.0}, [], "scale"),
    ],
)
def test_bad_parameters_name_the_parameter(strategy, global_params, model_params, bad):
    with pytest.raises(InvalidParameterError) as info:
        validate_parameters(get_strategy(strategy), global_params, model_params)
    assert info.value.param == bad
