"""Every field of an evolution request is bounded before anything runs: ids, splits, names, numbers."""

from __future__ import annotations

import copy

import pytest

from alloy.errors import AlloyError, ErrorCode
from evolution.config import parse_spec

VALID = {
    "models": ["ft-a", "ft-b"],
    "base_model": "base",
    "datasets": ["dev-set"],
    "genome": {"per_model": {"weight": {"low": 0.0, "high": 1.0}}},
    "search": {"kind": "random", "population": 2, "generations": 1, "seed": 3},
}


def with_change(path: str, value):
    data = copy.deepcopy(VALID)
    *parents, last = path.split(".")
    node = data
    for key in parents:
        node = node[key]
    node[last] = value
    return data


def test_the_valid_request_parses():
    assert parse_spec(VALID).search.seed == 3


@pytest.mark.parametrize(
    ("path", "value"),
    [
        ("models", ["ft-a", "ft\x00b"]),  # NUL in an id
        ("base_model", "../escape"),
        ("datasets", ["d"] * 33),
        ("dev_split", "dev\nsplit"),
        ("output_model_id", "x" * 500),
        ("name", "run\x07"),
        ("strategy", "t" * 1000),
        ("genome.per_model", {"weight": {"low": 0.0, "high": float("nan")}}),
        ("genome.per_model", {f"p{i}": {"low": 0.0, "high": 1.0} for i in range(33)}),
        ("search.seed", 2**64),
        ("search.seed", -1),
        ("search.target_fitness", float("inf")),
        ("search.dev_batch_size", 10**9),
        ("search.max_concurrent_trials", 10**6),
    ],
)
def test_out_of_bounds_fields_are_validation_failed(path, value):
    with pytest.raises(AlloyError) as raised:
        parse_spec(with_change(path, value))
    assert raised.value.code == ErrorCode.VALIDATION_FAILED


# --- refused before a job exists (the ingress calls check_before_job before it creates one) ---------------------


def test_a_valid_request_passes_the_pre_job_check_explicit_or_preset():
    from evolution.inputs import check_before_job

    check_before_job(parse_spec(VALID))
    preset = {"preset": "tiny", "genome": {"global_parameters": {"lambda": {"low": 0.1, "high": 1.5}}}}
    check_before_job(parse_spec(preset))
    own_lambda = {"task_arithmetic": [0.3, 1.2], "tsv": [0.7, 3.0]}
    per_method = {"operators": ["task_arithmetic", "tsv"], "operator_parameters": {"lambda": own_lambda}}
    check_before_job(parse_spec({**VALID, "genome": per_method}))


@pytest.mark.parametrize(
    ("change", "code"),
    [
        ({"strategy": "linear"}, ErrorCode.INVALID_STRATEGY),
        ({"preset": "no-such-preset"}, ErrorCode.VALIDATION_FAILED),
        ({"genome": {"per_model": {"not_a_parameter": {"low": 0.0, "high": 1.0}}}}, ErrorCode.VALIDATION_FAILED),
        ({"genome": {"per_model": {"weight": {"low": 0.0, "high": 1.0}}, "operators": ["nope"]}}, None),
        (  # a per-method lambda missing for one listed method
            {"genome": {"operators": ["task_arithmetic", "tsv"], "operator_parameters": {"lambda": {"tsv": [1, 3]}}}},
            ErrorCode.VALIDATION_FAILED,
        ),
    ],
)
def test_what_the_run_would_refuse_is_refused_before_a_job(change, code):
    from evolution.inputs import check_before_job

    with pytest.raises(AlloyError) as raised:
        check_before_job(parse_spec({**VALID, **change}))
    assert code is None or raised.value.code == code
