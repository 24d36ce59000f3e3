"""The deployed app over real HTTP through the Serve proxy: health, auth on it, OpenAPI, metrics."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.ray


def test_health_reports_every_component_and_cluster_state(alloy_service):
    response = alloy_service.client("read").get("/health")
    assert response.status_code == 200, response.text
    body = response.json()
    for name in (
        "ModelRegistry",
        "DatasetRegistry",
        "MergeEngine",
        "EvaluationEngine",
        "EvolutionEngine",
        "ExperimentTracker",
        "ArtifactStore",
        "Database",
    ):
        assert body["components"][name]["status"] == "healthy", (name, body["components"][name])
    assert body["cluster_state"] == "READY"
    assert body["config_version"] >= 1
    assert body["profile"] == "cpu"
    assert any(node["alive"] for node in body["nodes"])


def test_health_needs_an_api_key(alloy_service):
    response = alloy_service.client(scope=None).get("/health")
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "UNAUTHENTICATED"


def test_openapi_types_every_route(alloy_service):
    spec = alloy_service.client(scope=None).get("/openapi.json").json()
    assert "/merge/execute" in spec["paths"]
    execute = spec["paths"]["/merge/execute"]["post"]
    assert "202" in execute["responses"]
    assert execute["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("MergeRequest")
    assert spec["paths"]["/jobs/{job_id}"]["get"]["responses"]["200"]["content"]["application/json"]["schema"][
        "$ref"
    ].endswith("JobView")
