"""``alloy submit merge`` as a thin user of alloy.client: URL and key from the environment, repeated --param
refused, --slice for franken merges, --recipe files, --evaluate, one clean progress line, structured errors."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from alloy.cli.main import cli


def _run(*args: str, env: dict[str, str] | None = None):
    return CliRunner().invoke(cli, ["submit", "merge", *args], env=env)


def test_help_shows_the_environment_defaults_and_nothing_is_required_but_the_output():
    result = _run("--help")
    assert result.exit_code == 0
    assert "ALLOY_URL" in result.output and "ALLOY_API_KEY" in result.output
    assert "127.0.0.1:8000" not in result.output
    for option in ("--slice", "--evaluate", "--recipe"):
        assert option in result.output


def test_a_parameter_given_twice_is_refused_before_anything_is_sent():
    result = _run(
        "--models",
        "a",
        "b",
        "--strategy",
        "slerp",
        "-p",
        "t=0.2",
        "-p",
        "t=0.8",
        "-o",
        "x",
        "--url",
        "http://127.0.0.1:9",
    )
    assert result.exit_code == 2 and "given twice" in result.output


def test_a_malformed_slice_is_refused():
    result = _run("--strategy", "franken_merge", "--slice", "a:4", "-o", "x", "--url", "http://127.0.0.1:9")
    assert result.exit_code == 2 and "MODEL:START-END" in result.output


def test_an_unreachable_service_is_one_line_not_a_traceback():
    result = _run(
        "--models",
        "a",
        "b",
        "--strategy",
        "slerp",
        "-p",
        "t=0.5",
        "-o",
        "x",
        env={"ALLOY_URL": "http://127.0.0.1:9", "ALLOY_API_KEY": "k"},
    )
    assert result.exit_code == 1
    assert "SERVICE_UNAVAILABLE" in result.output and "127.0.0.1:9" in result.output
    assert "Traceback" not in result.output


@pytest.mark.ray
def test_url_and_key_from_the_environment_and_one_progress_line(alloy_service, served_models):
    env = {"ALLOY_URL": alloy_service.base_url, "ALLOY_API_KEY": alloy_service.keys["write"]}
    result = _run("--models", "tune1", "tune2", "--strategy", "slerp", "-p", "t=0.3", "-o", "cli-env", env=env)
    assert result.exit_code == 0, result.output
    assert result.output.strip().endswith("COMPLETED: model cli-env")
    # The bar is drawn by one display only: its final line appears once.
    assert sum("100%" in line for line in result.output.splitlines()) == 1


@pytest.mark.ray
def test_franken_merge_with_slices(alloy_service, served_models):
    env = {"ALLOY_URL": alloy_service.base_url, "ALLOY_API_KEY": alloy_service.keys["write"]}
    result = _run(
        "--strategy", "franken_merge", "--slice", "tune1:0-1", "--slice", "tune2:1-2", "-o", "cli-franken", env=env
    )
    assert result.exit_code == 0, result.output
    assert "COMPLETED: model cli-franken" in result.output


@pytest.mark.ray
def test_recipe_file_in_mergekit_format(alloy_service, served_models, tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        "merge_method: ties\nbase_model: base\nmodels:\n"
        "  - model: tune1\n    parameters: {density: 0.5, weight: 0.5}\n"
        "  - model: tune2\n    parameters: {density: 0.5, weight: 0.5}\n"
        "dtype: float32\n"
    )
    env = {"ALLOY_URL": alloy_service.base_url, "ALLOY_API_KEY": alloy_service.keys["write"]}
    result = _run("--recipe", str(recipe), "-o", "cli-recipe", env=env)
    assert result.exit_code == 0, result.output
    assert "COMPLETED: model cli-recipe" in result.output
    bad = _run("--recipe", str(recipe), "--strategy", "slerp", "-o", "cli-recipe2", env=env)
    assert bad.exit_code == 2 and "--recipe replaces" in bad.output


@pytest.mark.ray
def test_service_errors_print_the_code(alloy_service, served_models):
    env = {"ALLOY_URL": alloy_service.base_url, "ALLOY_API_KEY": alloy_service.keys["write"]}
    result = _run("--models", "tune1", "ghost", "--strategy", "ties", "-o", "cli-ghost", env=env)
    assert result.exit_code == 1 and "MODEL_NOT_FOUND" in result.output


@pytest.mark.ray
def test_evaluate_scores_the_merge_before_completed_and_prints_the_scores(alloy_service, tiny_zoo):
    env = {"ALLOY_URL": alloy_service.base_url, "ALLOY_API_KEY": alloy_service.keys["write"]}
    result = _run(
        "--models",
        "tiny-lm-ft-words",
        "tiny-lm-ft-sums",
        "--strategy",
        "task_arithmetic",
        "--base",
        "tiny-lm-base",
        "--evaluate",
        "tiny-ppl-words",
        "--split",
        "dev",
        "-o",
        "cli-evaluated",
        env=env,
    )
    assert result.exit_code == 0, result.output
    assert "COMPLETED: model cli-evaluated" in result.output
    [score] = [line for line in result.output.splitlines() if line.startswith("  tiny-ppl-words (dev): perplexity ")]
    assert float(score.split()[3]) > 1.0  # a perplexity, read back from the job's typed result
    client = alloy_service.client("read")
    [job] = [
        j for j in client.get("/jobs", params={"limit": 200}).json()["items"] if j.get("model_id") == "cli-evaluated"
    ]
    states = [event["to_state"] for event in client.get(f"/jobs/{job['job_id']}/events").json()]
    assert states == ["CREATED", "PREPARING", "RUNNING", "EVALUATING", "COMPLETED"]

    unknown = _run(
        "--models", "tiny-lm-ft-words", "tiny-lm-ft-sums", "--strategy", "task_arithmetic", "--base", "tiny-lm-base",
        "--evaluate", "no-such-dataset", "-o", "cli-evaluated-2", env=env,
    )  # fmt: skip
    assert unknown.exit_code == 1 and "Traceback" not in unknown.output
