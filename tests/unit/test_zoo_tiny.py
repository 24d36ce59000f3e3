"""The zoo: the tiny preset builds in seconds, is reused, rebuilt atomically and reproducibly; sources that are
missing fail with the exact install command; the CLI builds and lists."""

from __future__ import annotations

import hashlib

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from alloy.errors import AlloyError
from alloy.evaluation import CandidateEvaluator, LocalDatasets
from alloy.zoo import sources
from alloy.zoo.manifest import MANIFEST_FILE
from alloy.zoo.presets import build_preset, load_preset, preset_root

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return tmp_path_factory.getbasetemp() / "zoo-data"  # shared with tests/test_eval_service.py


@pytest.fixture(scope="module")
def tiny(data_dir):
    return build_preset("tiny", data_dir)


def _digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_tiny_manifest_lists_models_and_datasets(tiny):
    assert tiny.preset == "tiny" and tiny.build_seconds < 120
    assert {m.model_id for m in tiny.models} == {
        "tiny-enc-base",
        "tiny-enc-ft-letters",
        "tiny-enc-ft-case",
        "tiny-lm-base",
        "tiny-lm-ft-words",
        "tiny-lm-ft-sums",
    }
    for model in tiny.models:
        assert (model.path / "model.safetensors").exists() and (model.path / "tokenizer.json").exists()
    for dataset in tiny.datasets:
        for split in dataset.splits:
            assert dataset.split_path(split).exists()
    assert [m.model_id for m in tiny.finetunes("tiny-enc-base")] == ["tiny-enc-ft-letters", "tiny-enc-ft-case"]


def test_fine_tunes_gain_on_their_own_task(tiny):
    evaluator = CandidateEvaluator(
        tiny.model("tiny-enc-base").path, LocalDatasets(tiny.datasets), ["tiny-letters", "tiny-case"], "test"
    )
    base = evaluator.score_loaded()
    for model_id, task in (("tiny-enc-ft-letters", "tiny-letters"), ("tiny-enc-ft-case", "tiny-case")):
        tuned = evaluator.score(load_file(str(tiny.model(model_id).path / "model.safetensors")))
        assert tuned[task] > base[task], (model_id, tuned, base)


def test_finished_build_is_reused_and_staging_leftovers_are_removed(tiny, data_dir):
    root = preset_root("tiny", data_dir)
    leftover = root.parent / ".staging-tiny-99999"
    leftover.mkdir()
    (leftover / "half.bin").write_bytes(b"x")
    again = build_preset("tiny", data_dir)
    assert again.build_seconds == tiny.build_seconds  # reused, not rebuilt
    assert leftover.exists()  # a reuse touches nothing
    assert load_preset("tiny", data_dir).root == root.resolve()


def test_forced_rebuild_is_atomic_and_reproducible(tiny, tmp_path):
    other = build_preset("tiny", tmp_path)
    for model in tiny.models:
        assert _digest(model.path / "model.safetensors") == _digest(
            other.model(model.model_id).path / "model.safetensors"
        )
    for dataset in tiny.datasets:
        assert _digest(dataset.split_path("test")) == _digest(other.dataset(dataset.dataset_id).split_path("test"))
    (tmp_path / "zoo" / ".staging-tiny-1").mkdir()
    rebuilt = build_preset("tiny", tmp_path, force=True)
    assert (rebuilt.root / MANIFEST_FILE).exists()
    assert not list((tmp_path / "zoo").glob(".staging-*"))


def test_missing_sources_fail_with_the_install_command(monkeypatch, tmp_path):
    monkeypatch.setattr(sources, "WORDNET_DIR", tmp_path / "no-wordnet")
    with pytest.raises(AlloyError) as error:
        sources.wordnet_dir()
    assert error.value.message.endswith(
        "install it with: apt-get update && apt-get install -y --no-install-recommends "
        "wordnet-base fortunes fortunes-de fortunes-es fortunes-it"
    )
    with pytest.raises(AlloyError) as error:  # whichever source is missing first, the message says how to fix it
        build_preset("encoder-5task", tmp_path)
    assert "install it with: " in error.value.message
    assert not (tmp_path / "zoo").exists()  # nothing staged before the sources are checked


def test_unknown_preset_is_refused(tmp_path):
    with pytest.raises(AlloyError) as error:
        build_preset("huge", tmp_path)
    assert error.value.code.value == "VALIDATION_FAILED"


def test_cli_build_and_list(tiny, data_dir):
    from alloy.cli.zoo import zoo

    runner = CliRunner()
    built = runner.invoke(zoo, ["build", "tiny", "--data-dir", str(data_dir)])
    assert built.exit_code == 0, built.output
    assert "tiny-enc-ft-case" in built.output and "tiny-ppl-words" in built.output
    listed = runner.invoke(zoo, ["list", "--data-dir", str(data_dir)])
    assert listed.exit_code == 0 and "tiny" in listed.output and "built (" in listed.output
    missing = runner.invoke(zoo, ["build", "nope", "--data-dir", str(data_dir)])
    assert missing.exit_code != 0 and "unknown preset" in missing.output


def test_cli_evaluate_a_folder(tiny, data_dir):
    from alloy.cli.evaluate import evaluate

    result = CliRunner().invoke(
        evaluate,
        [str(tiny.model("tiny-lm-ft-words").path), "--preset", "tiny", "--data-dir", str(data_dir), "--split", "dev"],
    )
    assert result.exit_code == 0, result.output
    assert "tiny-ppl-words" in result.output and "perplexity" in result.output and "tiny-lm-kind" in result.output


def test_merge_quality_bench_runs_on_tiny(tiny, data_dir, capsys):
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "bench" / "merge_quality.py"
    spec = importlib.util.spec_from_file_location("merge_quality_bench", path)
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench  # dataclasses look their module up there
    spec.loader.exec_module(bench)
    assert (
        bench.main(
            [
                "--preset",
                "tiny",
                "--data-dir",
                str(data_dir),
                "--family",
                "tiny-enc-base",
                "--lambdas",
                "0.5",
                "--densities",
                "0.5",
                "--ties-lambdas",
                "1.0",
                "--dare-lambdas",
                "0.5",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    for row in (
        "base (tiny-enc-base)",
        "each fine-tune on its own task",
        "uniform average",
        "task arithmetic λ=0.5",
        "TIES keep 50% λ=1",
        "DARE drop 90% + TA λ=0.5",
    ):
        assert f"| {row} |" in out
