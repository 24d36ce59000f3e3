"""Parameter forms (scalar, gradient, filter list) and a parameter spec's checks."""

from __future__ import annotations

import pytest

from kernels.errors import InvalidParameterError
from kernels.params import interpolate, layer_index, resolve_value
from kernels.registry import get_method


def test_gradient_is_piecewise_linear_over_depth():
    points = [0.0, 1.0, 0.5]
    assert interpolate(points, 0.0) == 0.0
    assert interpolate(points, 0.25) == 0.5  # halfway between points 0 and 1
    assert interpolate(points, 0.5) == 1.0
    assert interpolate(points, 0.75) == 0.75  # halfway between 1.0 and 0.5
    assert interpolate(points, 1.0) == 0.5


def test_layer_index_reads_the_block_number():
    assert layer_index("model.layers.3.self_attn.q_proj.weight") == 3
    assert layer_index("transformer.h.11.attn.c_attn.weight") == 11
    assert layer_index("model.embed_tokens.weight") is None


def test_filter_list_first_match_wins_and_values_may_be_gradients():
    value = [{"filter": "self_attn", "value": [0.0, 1.0]}, {"filter": "mlp", "value": 0.9}, {"value": 0.7}]
    assert resolve_value(value, "model.layers.1.self_attn.v_proj.weight", 0.25) == 0.25
    assert resolve_value(value, "model.layers.1.mlp.up_proj.weight", 0.25) == 0.9
    assert resolve_value(value, "model.norm.weight", 0.25) == 0.7
    assert resolve_value([{"filter": "mlp", "value": 0.9}], "model.norm.weight", 0.0) is None


@pytest.mark.parametrize(
    ("method", "name", "value"),
    [
        ("slerp", "t", 1.5),
        ("slerp", "t", [0.0, 2.0]),  # every gradient point is range-checked
        ("ties", "density", -0.1),
        ("dare_linear", "rescale", "yes"),
        ("dare_linear", "density", [{"filter": "mlp", "value": 1.2}]),
        ("karcher", "max_iter", 2.5),
    ],
)
def test_bad_parameter_values_name_the_parameter(method, name, value):
    with pytest.raises(InvalidParameterError) as info:
        get_method(method).param(name).check(value)
    assert info.value.param == name


def test_unknown_parameter_is_named():
    with pytest.raises(InvalidParameterError) as info:
        get_method("ties").param("densty")
    assert info.value.param == "densty"
