"""Every recipe form of mergekit 0.1.5 on pico models of several families (Llama and Mistral with grouped-query
attention, Qwen2 with tied embeddings, GPT-2 with its fused ``c_attn``): Alloy's merge loads with transformers and
gives finite logits; and, when mergekit is installed in its own venv (``/work/mkvenv`` or
``$ALLOY_MERGEKIT_PYTHON``), the same recipes through ``mergekit-yaml`` give the same tensors (max abs diff <= 1e-6;
in a bfloat16 / float16 output, which both compute in that dtype, an element may differ only as a rounding
neighbour or at a top-k threshold tie; random methods: kept fraction and L1 norm of the task vector within 0.5%).
The recipes are ``bench/mergekit_recipes.py``'s, the one list shared with the benchmark."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from alloy.cli.merge import resolve_source
from alloy.errors import AlloyError, ErrorCode
from alloy.merge.executor import execute_merge
from alloy.merge.mergekit import load_recipe_yaml
from bench.mergekit_diff import (
    CASES,
    compare,
    layer_count,
    mergekit_python,
    model_class,
    pico_family,
    run_mergekit_batch,
    trimmed_inputs,
)

torch.set_num_threads(1)
BY_NAME = {case.name: case for case in CASES}
MERGED = sorted(name for name, case in BY_NAME.items() if not case.refused)
REFUSED = sorted(name for name, case in BY_NAME.items() if case.refused)
IGNORING = sorted(name for name, case in BY_NAME.items() if case.ignored)


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    root = tmp_path_factory.mktemp("pico")
    return {arch: pico_family(root, arch) for arch in sorted({c.arch for c in CASES})}


@pytest.fixture(scope="module")
def alloy_outputs(families, tmp_path_factory):
    """Every case merged by Alloy (in this process, through the recipe loader and the streaming executor)."""
    root = tmp_path_factory.mktemp("alloy-out")
    outputs: dict[str, Path | AlloyError] = {}
    for case in CASES:
        models = families[case.arch]
        try:
            recipe = load_recipe_yaml(case.text(models))
            sources = {m: resolve_source(m, root) for m in recipe.model_ids}  # as ``alloy merge`` finds them
            result = execute_merge(recipe, sources, root / case.name)
            outputs[case.name] = root / case.name
            (root / case.name / "warnings.txt").write_text("\n".join(result.warnings))
        except AlloyError as exc:
            outputs[case.name] = exc
    return outputs


@pytest.fixture(scope="module")
def mergekit_outputs(families, tmp_path_factory):
    python = mergekit_python()
    if python is None:
        pytest.skip(
            "mergekit is not installed here (CI has none): set ALLOY_MERGEKIT_PYTHON to a python with "
            "mergekit 0.1.5 to run the differential half"
        )
    root = tmp_path_factory.mktemp("mergekit-out")
    jobs = []
    for case in (c for c in CASES if not c.refused):  # a refused recipe has nothing to compare
        config = root / f"{case.name}.yml"
        config.write_text(case.text(families[case.arch]))
        jobs.append((config, root / case.name))
    failures = run_mergekit_batch(python, jobs, root)
    (root / "mergekit-failures.log").write_text(failures)
    return {case.name: root / case.name for case in CASES if not case.refused}


def test_the_recipes_cover_every_family_and_form():
    assert {c.arch for c in CASES} >= {"llama", "mistral", "qwen2", "gpt2", "mistral3"}
    texts = "\n".join(c.recipe for c in CASES)
    for form in ("slices:", "filter:", "out_dtype:", "scale:", "int8_mask", "lambda:", "normalize:", "}+{"):
        assert form in texts, form


def test_every_basic_merge_config_and_example_is_a_case():
    origins = [c.origin for c in CASES]
    assert origins.count("test_basic_merges") >= 50  # 25 configurations, 12 of them again as LLaVA-style models
    examples = ("gradient-slerp", "ties", "linear", "orcamini-platy-44layer", "bio-merge", "arcee_fusion")
    assert {f"examples/{e}.yml" for e in examples} <= set(origins)


@pytest.mark.parametrize("name", IGNORING)
def test_keys_the_method_does_not_read_are_ignored_as_mergekit_does_and_named_in_a_warning(alloy_outputs, name):
    assert isinstance(alloy_outputs[name], Path), alloy_outputs[name]
    warnings = (alloy_outputs[name] / "warnings.txt").read_text().splitlines()
    assert [w.split(":")[0] for w in warnings] == list(BY_NAME[name].ignored)


@pytest.mark.parametrize("name", REFUSED)
def test_refused_recipes_are_refused_by_name(alloy_outputs, name):
    refusal = alloy_outputs[name]
    assert isinstance(refusal, AlloyError) and refusal.code is ErrorCode.VALIDATION_FAILED
    assert refusal.details["field"] == BY_NAME[name].refused


@pytest.mark.parametrize("name", MERGED)
def test_alloy_output_loads_and_gives_finite_logits(alloy_outputs, name):
    assert isinstance(alloy_outputs[name], Path), alloy_outputs[name]
    model = model_class(BY_NAME[name].arch).from_pretrained(str(alloy_outputs[name]))
    config = getattr(model.config, "text_config", model.config)
    assert config.num_hidden_layers == (layer_count(alloy_outputs[name]) or config.num_hidden_layers)
    with torch.no_grad():
        logits = model(torch.tensor([[1, 5, 9, 2]])).logits
    assert torch.isfinite(logits).all()


def _known(name: str):
    reason = BY_NAME[name].known_difference
    return pytest.param(name, marks=pytest.mark.xfail(strict=True, reason=reason)) if reason else name


@pytest.mark.parametrize("name", [_known(n) for n in MERGED])
def test_alloy_gives_mergekits_tensors(alloy_outputs, mergekit_outputs, families, name):
    case = BY_NAME[name]
    assert isinstance(alloy_outputs[name], Path), alloy_outputs[name]
    assert (mergekit_outputs[name] / "config.json").exists(), (
        mergekit_outputs[name].parent / "mergekit-failures.log"
    ).read_text()[-3000:]
    models = families[case.arch]
    report = compare(
        alloy_outputs[name],
        mergekit_outputs[name],
        random=case.random,
        base_dir=models["base"],
        trimmed=trimmed_inputs(case, models),
    )
    assert report["same_tensors"], (report["only_alloy"], report["only_mergekit"])
    assert report["layers"][0] == report["layers"][1]
    assert report["dtypes_equal"]
    assert report["ok"], {k: v for k, v in report.items() if k not in ("only_alloy", "only_mergekit")}


def test_the_merged_folder_keeps_the_mergekit_recipe(alloy_outputs, families):
    case = BY_NAME["example-ties"]
    assert (Path(alloy_outputs[case.name]) / "mergekit_config.yml").read_text() == case.text(families[case.arch])
