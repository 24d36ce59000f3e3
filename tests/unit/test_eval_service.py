"""EvaluationService over real SQLite registries, artifact store, tracker and job store, on the tiny preset."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from alloy.errors import AlloyError, ErrorCode
from alloy.evaluation import CandidateEvaluator, EvaluationService, LocalDatasets, evaluate_model_dir
from alloy.zoo.presets import build_preset, register_preset

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tiny_zoo(tmp_path_factory):
    # Shared with tests/test_zoo_tiny.py through the session's base temp folder; builds are idempotent.
    return build_preset("tiny", tmp_path_factory.getbasetemp() / "zoo-data")


@pytest.fixture(scope="module")
def stack(tiny_zoo, tmp_path_factory):
    from alloy.jobs.store import JobStore
    from alloy.registry.datasets import DatasetRegistry
    from alloy.registry.models import ModelRegistry
    from alloy.storage.artifacts import ArtifactStore
    from alloy.storage.db import Database
    from alloy.storage.tracker import ExperimentTracker

    root = tmp_path_factory.mktemp("eval-service")
    db = Database(f"sqlite:///{root / 'alloy.db'}")
    db.upgrade()
    store = ArtifactStore(str(root / "artifacts"))
    models = ModelRegistry(db, store, model_roots=[tiny_zoo.root], data_dir=root)
    datasets = DatasetRegistry(db, store)
    register_preset(tiny_zoo, models, datasets, store=store)
    tracker, jobs = ExperimentTracker(db), JobStore(db)
    service = EvaluationService(models, datasets, tracker, jobs, store)
    yield service
    db.close()


def test_register_preset_is_idempotent(stack, tiny_zoo):
    again = register_preset(tiny_zoo, stack.models, stack.datasets, store=stack.store)
    assert again == {"models": [], "datasets": []}
    task = stack.datasets.get("tiny-letters").task
    assert task["head_artifact"] == "zoo/tiny/tiny-letters/head.safetensors"


def test_evaluate_model_logs_results_and_matches_local_scoring(stack, tiny_zoo):
    results = stack.evaluate_model("tiny-enc-ft-letters", ["tiny-letters", "tiny-case"], split="test")
    assert [(r.dataset_id, r.metric, r.split, r.n) for r in results] == [
        ("tiny-letters", "accuracy", "test", 96),
        ("tiny-case", "accuracy", "test", 64),
    ]
    logged = stack.tracker.results(stack.last_experiment_id)
    assert {(m.dataset_id, m.metric): m.value for m in logged} == {(r.dataset_id, r.metric): r.value for r in results}
    # the same numbers from the preset's local folders (no registry in between)
    local = CandidateEvaluator(
        tiny_zoo.model("tiny-enc-base").path, LocalDatasets(tiny_zoo.datasets), ["tiny-letters", "tiny-case"], "test"
    )
    scores = local.score(load_file(str(tiny_zoo.model("tiny-enc-ft-letters").path / "model.safetensors")))
    assert scores["tiny-letters"] == pytest.approx(results[0].value)
    assert scores["tiny-case"] == pytest.approx(results[1].value)


def test_candidate_evaluator_equals_evaluating_the_saved_model(stack, tiny_zoo):
    evaluator = stack.candidate_evaluator("tiny-enc-base", ["tiny-case"], split="dev")
    state = load_file(str(tiny_zoo.model("tiny-enc-ft-case").path / "model.safetensors"))
    [saved] = stack.evaluate_model("tiny-enc-ft-case", ["tiny-case"], split="dev")
    assert evaluator.score(state)["tiny-case"] == pytest.approx(saved.value)
    # a subset by index, and the base model scores differently from its fine-tune
    assert evaluator.score(state, batch_indices=[0, 1, 2, 3])["mean_accuracy"] in (0.0, 0.25, 0.5, 0.75, 1.0)
    with pytest.raises(AlloyError) as error:
        evaluator.score({"not.a.weight": torch.zeros(1)})
    assert error.value.code is ErrorCode.VALIDATION_FAILED


def test_causal_lm_perplexity_and_loglik(stack):
    results = {
        r.dataset_id: r
        for r in stack.evaluate_model(
            "tiny-lm-ft-words", ["tiny-ppl-words", "tiny-ppl-sums", "tiny-lm-kind"], split="test"
        )
    }
    assert results["tiny-ppl-words"].metric == "perplexity"
    assert results["tiny-ppl-words"].value < results["tiny-ppl-sums"].value  # trained on words
    [base] = stack.evaluate_model("tiny-lm-base", ["tiny-ppl-words"], split="test")
    assert results["tiny-ppl-words"].value < base.value
    assert results["tiny-lm-kind"].metric == "accuracy" and 0.0 <= results["tiny-lm-kind"].value <= 1.0


def test_run_job_completes_with_progress_and_results(stack):
    job = stack.jobs.create("evaluation", {"model_id": "tiny-enc-ft-case", "datasets": ["tiny-case"], "split": "dev"})
    done = stack.run_job(job.id)
    assert done.state.value == "COMPLETED"
    assert done.progress["percent"] == 100.0
    [result] = done.result["results"]
    assert result["dataset_id"] == "tiny-case" and result["metric"] == "accuracy" and result["n"] == 32
    assert [e.to_state.value for e in stack.jobs.events(job.id)] == ["CREATED", "PREPARING", "RUNNING", "COMPLETED"]
    assert stack.run_job(job.id).state.value == "COMPLETED"  # a finished job is left as it is


def test_run_job_with_several_models_as_the_http_api_sends_them(stack):
    job = stack.jobs.create(
        "evaluation", {"models": ["tiny-enc-base", "tiny-enc-ft-case"], "datasets": ["tiny-case"], "split": "dev"}
    )
    done = stack.run_job(job.id)
    assert done.state.value == "COMPLETED", done.error
    assert [r["model_id"] for r in done.result["results"]] == ["tiny-enc-base", "tiny-enc-ft-case"]
    assert done.progress["percent"] == 100.0


@pytest.mark.parametrize(
    "request_body, code",
    [
        ({"model_id": "nope", "datasets": ["tiny-case"]}, "MODEL_NOT_FOUND"),
        ({"model_id": "tiny-enc-base", "datasets": ["no-such-dataset"]}, "NOT_FOUND"),
        ({"model_id": "tiny-enc-base", "datasets": []}, "VALIDATION_FAILED"),
        ({"model_id": "tiny-enc-base", "models": ["tiny-enc-base"], "datasets": ["tiny-case"]}, "VALIDATION_FAILED"),
        ({"models": ["tiny-enc-base", "nope"], "datasets": ["tiny-case"]}, "MODEL_NOT_FOUND"),
        ({"model_id": "tiny-enc-base", "datasets": ["tiny-ppl-words"], "split": "dev"}, "VALIDATION_FAILED"),
        ({"model_id": "tiny-enc-base", "datasets": ["tiny-case"], "split": "nosuchsplit"}, "NOT_FOUND"),
    ],
)
def test_run_job_fails_with_codes(stack, request_body, code):
    job = stack.jobs.create("evaluation", request_body)
    failed = stack.run_job(job.id)
    assert failed.state.value == "FAILED"
    assert failed.error.code == code


def test_cache_counts_hits_and_clears(stack):
    stack.clear_cache()
    stack.evaluate_model("tiny-enc-base", ["tiny-case"], split="dev")
    stack.evaluate_model("tiny-enc-base", ["tiny-case"], split="dev")
    stats = stack.cache_stats()
    assert (stats["hits"], stats["misses"], stats["size"]) == (1, 1, 1)
    assert stack.clear_cache() == 1
    assert stack.cache_stats()["hits"] == 0


def test_post_merge_evaluation_of_a_folder(stack, tiny_zoo):
    summary = evaluate_model_dir(
        tiny_zoo.model("tiny-enc-ft-case").path,
        ["tiny-case"],
        "dev",
        datasets=stack.datasets,
        db=stack.models.db,
        model_id="merged-x",
    )
    assert summary["metrics"]["tiny-case"]["accuracy"] == pytest.approx(summary["results"][0]["value"])
    assert summary["experiment_id"] is not None
