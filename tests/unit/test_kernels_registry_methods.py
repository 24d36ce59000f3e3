"""``kernels.registry.METHODS``: mergekit 0.1.5's method names, parameters, defaults, scopes and input contracts,
the plain-data catalogue, and the kernel contract every method keeps (float32 out, inputs untouched)."""

from __future__ import annotations

import json

import pytest
import torch

from kernels.catalogue import method_catalogue
from kernels.errors import InvalidParameterError, UnknownStrategyError
from kernels.registry import ALLOY_ONLY_METHODS, METHODS, get_method

MERGEKIT_METHODS = {
    "linear",
    "slerp",
    "nuslerp",
    "multislerp",
    "karcher",
    "task_arithmetic",
    "ties",
    "dare_ties",
    "dare_linear",
    "breadcrumbs",
    "breadcrumbs_ties",
    "della",
    "della_linear",
    "sce",
    "model_stock",
    "nearswap",
    "arcee_fusion",
    "passthrough",
    "ram",
    "ramplus_tl",
}

FAMILIES = {
    "slerp": {"slerp", "nuslerp", "multislerp", "karcher"},
    "ties": {"ties", "breadcrumbs", "breadcrumbs_ties", "della", "della_linear", "sce"},
    "dare": {"dare_ties", "dare_linear"},
    "task_arithmetic": {
        "task_arithmetic",
        "linear",
        "model_stock",
        "nearswap",
        "arcee_fusion",
        "ram",
        "ramplus_tl",
        "tsv",
        "iso_c",
        "iso_cts",
    },
    "franken_merge": {"passthrough"},
}


def test_methods_are_keyed_by_mergekit_names_and_grouped_in_the_five_families():
    assert set(METHODS) - ALLOY_ONLY_METHODS == MERGEKIT_METHODS
    assert ALLOY_ONLY_METHODS == {"tsv", "iso_c", "iso_cts"}  # Alloy-only (tests/test_kernels_tsv_iso.py)
    for family, names in FAMILIES.items():
        assert {name for name, spec in METHODS.items() if spec.family == family} == names


def _defaults(name: str) -> dict:
    return {p.name: p.default for p in get_method(name).params}


@pytest.mark.parametrize(
    ("method", "normalize", "rescale"),
    [
        ("task_arithmetic", False, False),
        ("ties", True, False),
        ("dare_ties", False, True),
        ("dare_linear", False, True),
        ("breadcrumbs", False, False),
        ("breadcrumbs_ties", False, False),
        ("della", True, True),
        ("della_linear", False, True),
    ],
)
def test_generalized_task_arithmetic_defaults_are_mergekits(method, normalize, rescale):
    defaults = _defaults(method)
    assert defaults["normalize"] is normalize and defaults["rescale"] is rescale
    assert defaults["lambda"] == 1.0 and defaults["density"] == 1.0 and defaults["int8_mask"] is False
    weight = get_method(method).param("weight")
    assert weight.required and weight.scope == "per_model"
    assert get_method(method).requires_base


def test_method_specific_parameters():
    assert _defaults("breadcrumbs")["gamma"] == 0.01 and _defaults("breadcrumbs_ties")["gamma"] == 0.01
    assert _defaults("della")["epsilon"] == 0.15 and _defaults("della_linear")["epsilon"] == 0.15
    with pytest.raises(InvalidParameterError):  # ties declares no epsilon (that is della)
        get_method("ties").param("epsilon")
    assert _defaults("karcher") == {"max_iter": 10, "tol": 1e-5}
    assert get_method("karcher").param("max_iter").type is int
    assert _defaults("nuslerp") == {"weight": None, "nuslerp_row_wise": False, "nuslerp_flatten": True}
    assert _defaults("multislerp") == {"weight": None, "normalize_weights": True, "eps": 1e-8}
    assert _defaults("model_stock") == {"filter_wise": False}
    assert _defaults("sce") == {"int8_mask": False, "select_topk": 1.0}
    assert _defaults("ram") == {"epsilon": 1e-5}
    assert _defaults("ramplus_tl") == {"r": 0.1, "alpha": 0.2, "epsilon": 1e-5}
    assert _defaults("arcee_fusion") == {}
    assert get_method("slerp").param("t").required and get_method("nearswap").param("t").required
    assert get_method("linear").param("weight").scope == "input"  # every input, the base included
    assert get_method("passthrough").param("scale").scope == "input"
    assert _defaults("passthrough") == {"scale": None}


def test_only_the_bernoulli_and_magprune_methods_are_random():
    assert {name for name, spec in METHODS.items() if spec.random} == {
        "dare_ties",
        "dare_linear",
        "della",
        "della_linear",
    }


@pytest.mark.parametrize(
    ("method", "count", "has_base"),
    [
        ("slerp", 2, True),
        ("nearswap", 2, True),
        ("arcee_fusion", 2, True),
        ("nuslerp", 3, True),
        ("nuslerp", 2, False),
        ("multislerp", 1, False),
        ("model_stock", 3, True),
        ("ties", 1, True),
        ("karcher", 3, True),
        ("linear", 1, False),
        ("passthrough", 1, False),
    ],
)
def test_accepted_input_counts(method, count, has_base):
    get_method(method).check_inputs(count, has_base)


@pytest.mark.parametrize(
    ("method", "count", "has_base", "param"),
    [
        ("slerp", 3, True, "models"),
        ("slerp", 2, False, "base_model"),
        ("nearswap", 3, True, "models"),
        ("arcee_fusion", 1, True, "models"),
        ("nuslerp", 2, True, "models"),
        ("nuslerp", 3, False, "models"),
        ("model_stock", 2, True, "models"),
        ("ties", 3, False, "base_model"),
        ("passthrough", 2, False, "models"),
        ("sce", 2, False, "base_model"),
    ],
)
def test_refused_input_counts(method, count, has_base, param):
    with pytest.raises(InvalidParameterError) as info:
        get_method(method).check_inputs(count, has_base)
    assert info.value.param == param


def test_unknown_method_is_refused():
    with pytest.raises(UnknownStrategyError):
        get_method("dare")  # an HTTP family, not a mergekit method


def test_method_parameters_check_name_and_range():
    spec = get_method("della")
    spec.param("density").check(0.4)
    spec.param("epsilon").check(0.1)
    with pytest.raises(InvalidParameterError) as info:
        spec.param("density").check(1.5)
    assert info.value.param == "density"
    with pytest.raises(InvalidParameterError) as info:
        get_method("karcher").param("max_iter").check(2.5)
    assert info.value.param == "max_iter"


def test_catalogue_is_plain_data_for_every_method():
    catalogue = method_catalogue()
    assert json.loads(json.dumps(catalogue)) == catalogue
    assert {entry["name"] for entry in catalogue} == set(METHODS)
    ties = next(entry for entry in catalogue if entry["name"] == "ties")
    density = next(p for p in ties["parameters"] if p["name"] == "density")
    assert density == {
        "name": "density",
        "type": "float",
        "scope": "per_model",
        "default": 1.0,
        "required": False,
        "minimum": 0.0,
        "maximum": 1.0,
        "aliases": [],
        "description": density["description"],
    }
    assert ties["family"] == "ties" and ties["requires_base"] and ties["max_models"] is None
    slerp = next(entry for entry in catalogue if entry["name"] == "slerp")
    assert (slerp["min_models"], slerp["max_models"]) == (2, 2)


# --- the kernel contract, for every method ----------------------------------------------------------------------


def _inputs(spec, dtype=torch.float32):
    count = {2: 2, 1: 1, 3: 3}.get(spec.max_models, 4)
    g = torch.Generator().manual_seed(0)
    base = torch.randn(6, 5, generator=g)
    tensors = [base] + [base + 0.1 * torch.randn(6, 5, generator=g) for _ in range(count - 1)]
    return [t.to(dtype) for t in tensors]


def _call(spec, tensors, owned=False):
    base_index = None if spec.base == "ignored" else 0
    global_params = {p.name: p.default for p in spec.params if p.scope == "global"}
    if "t" in global_params:
        global_params["t"] = 0.3
    model_params = [
        {p.name: 0.5 if p.name in ("weight", "density") else p.default for p in spec.params if p.scope != "global"}
        for _ in tensors
    ]
    return spec.kernel(tensors, base_index, global_params, model_params, torch.Generator().manual_seed(1), owned=owned)


@pytest.mark.parametrize("method", sorted(METHODS))
def test_kernel_returns_float32_and_never_modifies_inputs_it_does_not_own(method):
    spec = get_method(method)
    tensors = _inputs(spec)
    copies = [t.clone() for t in tensors]
    out = _call(spec, tensors)
    assert out.dtype == torch.float32 and out.shape == tensors[0].shape and torch.isfinite(out).all()
    assert all(torch.equal(t, c) for t, c in zip(tensors, copies))
    assert all(out.data_ptr() != t.data_ptr() for t in tensors)
    # owned inputs may be reused as scratch, but the result is the same bits
    assert torch.equal(_call(spec, [t.clone() for t in copies], owned=True), out)


@pytest.mark.parametrize("method", sorted(METHODS))
def test_kernel_computes_in_float32_from_bfloat16_inputs(method):
    spec = get_method(method)
    low = _inputs(spec, torch.bfloat16)
    out = _call(spec, low)
    assert out.dtype == torch.float32
    assert torch.equal(out, _call(spec, [t.float() for t in low]))


def test_every_kernel_gives_the_same_bits_whatever_the_thread_count():
    g = torch.Generator().manual_seed(0)
    base = torch.randn(100, 1000, generator=g)  # 10^5 entries: big enough for torch to split work between threads
    family = [base] + [base + 0.05 * torch.randn(100, 1000, generator=g) for _ in range(3)]
    before = torch.get_num_threads()
    try:
        for name in sorted(METHODS):
            spec = get_method(name)
            count = {2: 2, 1: 1, 3: 3}.get(spec.max_models, 4)
            results = []
            for threads in (1, 2):
                torch.set_num_threads(threads)
                results.append(_call(spec, [t.reshape(-1) for t in family[:count]]))
            assert torch.equal(*results), name
    finally:
        torch.set_num_threads(before)


def test_required_parameters_must_be_set_for_every_model_but_the_base():
    from kernels.specs import check_required

    ties = get_method("ties")
    check_required(ties, {}, [{}, {"weight": 1.0}, {"weight": 0.5}], base_index=0)  # the base needs no weight
    check_required(ties, {"weight": 1.0}, [{}, {}, {}], base_index=0)  # a global value counts for every model
    with pytest.raises(InvalidParameterError) as info:
        check_required(ties, {}, [{}, {"weight": 1.0}, {}], base_index=0)
    assert info.value.param == "weight"
    with pytest.raises(InvalidParameterError):  # linear's weight is per input: the base needs one too
        check_required(get_method("linear"), {}, [{}, {"weight": 1.0}], base_index=0)
    with pytest.raises(InvalidParameterError) as info:
        check_required(get_method("slerp"), {}, [{}, {}], base_index=0)
    assert info.value.param == "t"
    check_required(get_method("karcher"), {}, [{}, {}], base_index=None)  # nothing required
