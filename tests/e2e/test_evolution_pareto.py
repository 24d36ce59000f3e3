"""A multi-objective (NSGA-II) evolution over real HTTP on the ``tiny`` preset: the Pareto front of per-dataset dev
scores in GET /evolutions/{id}, and a front member promoted to a registered model (POST .../promote) with the
refusals: a taken model id (409), an unknown member (404), an evolution without a front (409)."""

from __future__ import annotations

import pytest

from tests.e2e.test_evolution_http import TERMINAL, poll_evolution, tiny_request

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def nsga2_evolution(alloy_service) -> dict:
    client = alloy_service.client("write")
    request = tiny_request("tiny evolution, NSGA-II")
    request["search"].update(kind="nsga2", population=4, generations=2)
    accepted = client.post("/evolutions", json=request)
    assert accepted.status_code == 202, accepted.text
    final = poll_evolution(client, accepted.json()["progress_url"], until=TERMINAL)[-1]
    assert final["state"] == "COMPLETED", final["error"]
    return final


def test_the_front_is_non_dominated_and_scored_per_dataset(alloy_service, nsga2_evolution):
    from evolution.objectives import dominates

    front = nsga2_evolution["pareto_front"]
    assert front and front == nsga2_evolution["result"]["pareto_front"]
    datasets = sorted(front[0]["scores"])
    assert len(datasets) >= 2  # one objective per fitness dataset
    points = [[m["scores"][d] for d in datasets] for m in front]
    assert not any(dominates(a, b) for a in points for b in points)
    assert [m["fitness"] for m in front] == sorted((m["fitness"] for m in front), reverse=True)
    trials = alloy_service.client("read").get(nsga2_evolution["trials_url"]).json()["trials"]
    assert len(trials) == 8 and {m["candidate_id"] for m in front} <= {t["trial_id"] for t in trials}
    assert nsga2_evolution["result"]["search"]["kind"] == "nsga2"


def test_a_front_member_is_promoted_to_a_registered_model(alloy_service, nsga2_evolution):
    client = alloy_service.client("write")
    member = nsga2_evolution["pareto_front"][-1]
    url = f"{nsga2_evolution['progress_url']}/promote"
    promoted = client.post(url, json={"candidate_id": member["candidate_id"], "model_id": "tiny-pareto-pick"})
    assert promoted.status_code == 201, promoted.text
    body = promoted.json()
    assert body["model"]["id"] == "tiny-pareto-pick" and body["candidate_id"] == member["candidate_id"]
    assert 0.0 <= body["test"]["mean"] <= 1.0 and set(body["test"]["per_dataset"]) >= set(member["scores"])
    lineage = client.get("/models/tiny-pareto-pick").json()["lineage"]
    assert lineage["trial_id"] == member["candidate_id"] and lineage["promoted"] is True
    assert lineage["search"] == "nsga2" and lineage["recipe"]["models"] == member["recipe"]["models"]

    again = client.post(url, json={"candidate_id": member["candidate_id"], "model_id": "tiny-pareto-pick"})
    assert again.status_code == 409 and again.json()["error"]["code"] == "ALREADY_EXISTS", again.text
    unknown = client.post(url, json={"candidate_id": "no-such-candidate", "model_id": "tiny-pareto-other"})
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "NOT_FOUND", unknown.text


def test_an_evolution_without_a_front_refuses_promotion(alloy_service):
    client = alloy_service.client("write")
    request = tiny_request("tiny evolution, random search")
    request["search"].update(kind="random", population=2, generations=1)
    accepted = client.post("/evolutions", json=request)
    assert accepted.status_code == 202, accepted.text
    final = poll_evolution(client, accepted.json()["progress_url"], until=TERMINAL)[-1]
    assert final["state"] == "COMPLETED", final["error"]
    assert final["pareto_front"] is None and final["result"]["search"]["candidates"] == 2
    refused = client.post(
        f"{final['progress_url']}/promote", json={"candidate_id": final["result"]["best_trial"], "model_id": "x-1"}
    )
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "CONFLICT", refused.text
