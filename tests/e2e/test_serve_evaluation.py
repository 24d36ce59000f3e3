"""Evaluation through the Serve proxy: evaluation jobs (POST /evaluations, progress, results) and a merge that
evaluates its output before COMPLETED (the EVALUATING state), on the offline ``tiny`` preset."""

from __future__ import annotations

import json
import math
import os
import time

import pytest

pytestmark = pytest.mark.ray


def test_an_evaluation_job_runs_to_completed_and_serves_its_results(alloy_service, tiny_zoo):
    client = alloy_service.client("write")
    response = client.post(
        "/evaluations", json={"models": ["tiny-lm-base"], "datasets": ["tiny-ppl-words"], "split": "test"}
    )
    assert response.status_code == 202, response.text
    accepted = response.json()
    assert accepted["status"] == "CREATED" and response.headers["Location"] == accepted["progress_url"]

    final = alloy_service.wait_job(accepted["progress_url"])
    assert final["state"] == "COMPLETED", final

    results = client.get(f"/evaluations/{accepted['job_id']}/results")
    assert results.status_code == 200, results.text
    [result] = results.json()["results"]
    assert (result["model_id"], result["dataset_id"], result["split"], result["metric"]) == (
        "tiny-lm-base",
        "tiny-ppl-words",
        "test",
        "perplexity",
    )
    assert math.isfinite(result["value"]) and result["value"] > 1.0 and result["n"] > 0


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        ({"models": ["no-such-model"], "datasets": ["tiny-ppl-words"]}, 404, "MODEL_NOT_FOUND"),
        ({"models": ["tiny-lm-base"], "datasets": ["no-such-dataset"]}, 404, "NOT_FOUND"),
    ],
)
def test_evaluation_requests_naming_unknown_things_are_refused_at_once(alloy_service, tiny_zoo, body, status, code):
    response = alloy_service.client("write").post("/evaluations", json=body)
    assert response.status_code == status, response.text
    assert response.json()["error"]["code"] == code


def test_a_merge_can_evaluate_its_output_before_completing(alloy_service, tiny_zoo):
    client = alloy_service.client("write")
    response = client.post(
        "/merge/execute",
        json={
            "models": ["tiny-lm-ft-words", "tiny-lm-ft-sums"],
            "strategy": "task_arithmetic",
            "base_model": "tiny-lm-base",
            "output_model_id": "evaluated-merge",
            "evaluate": {"datasets": ["tiny-ppl-words"], "split": "test"},
        },
    )
    assert response.status_code == 202, response.text
    job_url = response.json()["progress_url"]

    final = alloy_service.wait_job(job_url)
    assert final["state"] == "COMPLETED", final
    [evaluation] = final["result"]["evaluation"]["results"]
    assert evaluation["metric"] == "perplexity" and math.isfinite(evaluation["value"])
    states = [event["to_state"] for event in client.get(f"{job_url}/events").json()]
    assert states.index("EVALUATING") > states.index("RUNNING") and states[-1] == "COMPLETED"


@pytest.fixture(scope="module")
def slow_lm(alloy_service, tiny_zoo, tmp_path_factory) -> str:
    """A bigger llama with the tiny LM's character tokenizer: an evaluation of seconds, so a kill lands mid-job."""
    import shutil

    from alloy.zoo.tiny_models import build_tiny_model

    tokenizer_dir = alloy_service.data_dir / "artifacts" / "models" / "tiny-lm-base"
    vocab = json.loads((tokenizer_dir / "config.json").read_text())["vocab_size"]
    folder = build_tiny_model(
        tmp_path_factory.mktemp("slow-lm") / "model", "llama", seed=5, layers=8, hidden=512, vocab=vocab
    )
    for name in tokenizer_dir.iterdir():
        if name.name.startswith(("tokenizer", "special_tokens", "vocab")):
            shutil.copy2(name, folder / name.name)
    alloy_service.register_model("slow-lm", folder)
    return "slow-lm"


def test_kill_9_of_an_evaluation_engine_replica_mid_job_recovers_within_30_s(alloy_service, slow_lm):
    """The EvaluationEngine replica scoring the job is killed outright: the job used to stay RUNNING until the
    whole cluster restarted (and a graceful stop waited 300 s for it). Serve replaces the replica, whose sweeper
    requeues the job (one attempt) and replays it to COMPLETED within 30 s of the kill plus its own run."""
    import ray

    from tests.e2e.test_serve_merge import _job_state, _replica_actor, assert_recovered_once

    datasets = ["tiny-ppl-words", "tiny-ppl-sums", "tiny-lm-kind"]
    response = alloy_service.client("write").post(
        "/evaluations", json={"models": [slow_lm], "datasets": datasets, "split": "test"}
    )
    assert response.status_code == 202, response.text
    job_id = response.json()["job_id"]
    deadline = time.monotonic() + 120
    while _job_state(alloy_service, job_id) != "RUNNING":
        assert time.monotonic() < deadline and _job_state(alloy_service, job_id) != "COMPLETED"
        time.sleep(0.05)
    ray.kill(_replica_actor("EvaluationEngine"), no_restart=True)
    killed_at = time.time()

    final = alloy_service.wait_job(response.json()["progress_url"], timeout_s=300)
    recovered_s = assert_recovered_once(alloy_service, final, killed_at)
    print(f"evaluation replayed {recovered_s:.1f}s after the kill, COMPLETED {time.time() - killed_at:.1f}s after it")
    results = alloy_service.client("read").get(f"/evaluations/{job_id}/results").json()["results"]
    assert sorted(r["dataset_id"] for r in results) == sorted(datasets)


def test_a_damaged_model_fails_an_evaluation_with_the_code_a_merge_gives(alloy_service, tiny_zoo, tmp_path_factory):
    """Truncated weights: the evaluation names the model and the file with VALIDATION_FAILED, as a merge does
    (it used to be INTERNAL_ERROR with the library's text); then the model is listed broken and refused."""
    import shutil

    source = alloy_service.data_dir / "artifacts" / "models" / "tiny-lm-base"
    copy = tmp_path_factory.mktemp("truncated") / "model"
    shutil.copytree(source, copy, ignore=shutil.ignore_patterns(".alloy-dir.json"))
    alloy_service.register_model("truncated-lm", copy)
    stored = alloy_service.data_dir / "artifacts" / "models" / "truncated-lm" / "model.safetensors"
    os.truncate(stored, stored.stat().st_size // 2)
    client = alloy_service.client("write")

    response = client.post("/evaluations", json={"models": ["truncated-lm"], "datasets": ["tiny-ppl-words"]})
    assert response.status_code == 202, response.text
    final = alloy_service.wait_job(response.json()["progress_url"])
    assert final["state"] == "FAILED" and final["error"]["code"] == "VALIDATION_FAILED", final
    message = final["error"]["message"]
    assert "model 'truncated-lm' is damaged" in message and "'model.safetensors'" in message, message
    assert str(alloy_service.data_dir) not in message
    assert client.get("/models/truncated-lm").json()["broken"]
    again = client.post("/evaluations", json={"models": ["truncated-lm"], "datasets": ["tiny-ppl-words"]})
    assert again.status_code == 422 and "damaged" in again.json()["error"]["message"], again.text
