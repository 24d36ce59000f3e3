"""Evaluation through the Serve proxy: evaluation jobs (POST /evaluations, progress, results) and a merge that
evaluates its output before COMPLETED (the EVALUATING state), on the offline ``tiny`` preset."""

from __future__ import annotations

import math

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
