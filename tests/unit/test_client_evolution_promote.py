"""The typed client's Pareto front and promotion calls, against a fake server (httpx.MockTransport)."""

from __future__ import annotations

import json

import httpx
import pytest

from alloy.client import Client
from alloy.client.errors import AlloyAPIError

MEMBER = {
    "candidate_id": "t1-g002",
    "generation": 2,
    "fitness": 0.8,
    "scores": {"a": 0.9, "b": 0.7},
    "genome": {"weight.0": 1.0},
    "recipe": {"strategy": "task_arithmetic"},
}
VIEW = {"job_id": "j1", "state": "COMPLETED", "progress_url": "http://x/evolutions/j1", "pareto_front": [MEMBER]}


def fake_server(request: httpx.Request) -> httpx.Response:
    if request.method == "GET" and request.url.path == "/evolutions/j1":
        return httpx.Response(200, json=VIEW)
    if request.method == "POST" and request.url.path == "/evolutions/j1/promote":
        body = json.loads(request.content)
        if body["model_id"] == "taken":
            error = {"code": "ALREADY_EXISTS", "message": "model 'taken' already exists", "details": {}}
            return httpx.Response(409, json={"error": error})
        model = {"id": body["model_id"], "lineage": {"trial_id": body["candidate_id"], "promoted": True}}
        test = {"metric": "mean_accuracy", "mean": 0.75, "per_dataset": {"a": 0.8}}
        return httpx.Response(
            201, json={"job_id": "j1", "candidate_id": body["candidate_id"], "model": model, "test": test}
        )
    return httpx.Response(404, json={"error": {"code": "NOT_FOUND", "message": "no", "details": {}}})


def test_the_front_and_a_promotion_are_typed():
    with Client("http://alloy.test", api_key="k", transport=httpx.MockTransport(fake_server)) as client:
        evolution = client.evolution("j1")
        front = evolution.pareto_front()
        assert [m.candidate_id for m in front] == ["t1-g002"] and front[0].scores["b"] == 0.7
        promoted = evolution.promote("t1-g002", "my-pick")
        assert promoted.model.id == "my-pick" and promoted.model.lineage["promoted"] is True
        assert promoted.test["mean"] == 0.75
        with pytest.raises(AlloyAPIError) as refused:
            evolution.promote("t1-g002", "taken")
        assert refused.value.code == "ALREADY_EXISTS" and refused.value.status == 409
