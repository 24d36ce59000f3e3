"""``POST /merge/execute`` with ``"dry_run": true``: 200 with a typed DryRunReport (in the OpenAPI document), no job
created; incompatible models are the verdict; a taken output id is still 409. The real FastAPI app over a real
SQLite database; the model registry is a stand-in handle answering from tiny models' manifests (no Ray)."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from alloy import components as c
from alloy.config import ConfigHolder, Settings
from alloy.errors import model_not_found
from alloy.merge import footprint
from alloy.model_manifest import read_manifest
from alloy.storage.db import Database
from alloy.storage.keys import ApiKeyStore


class _Method:
    def __init__(self, function):
        self.function = function

    def remote(self, *args):
        async def answer():
            return self.function(*args)

        return answer()


class StandInRegistry:
    """What the ModelRegistry deployment answers, for a fixed set of model folders."""

    def __init__(self, folders: dict[str, object], registered: set[str]):
        self.folders, self.registered = folders, registered
        self.manifests = _Method(self._manifests)
        self.exists = _Method(lambda model_id: model_id in self.registered)

    def _manifests(self, model_ids):
        missing = [m for m in model_ids if m not in self.folders]
        if missing:
            raise model_not_found(missing[0])
        return {m: read_manifest(self.folders[m]) for m in model_ids}


@pytest.fixture(scope="module")
def client(tmp_path_factory, tiny_model_factory):
    from deployments.runtime import Services
    from serve_app.api import create_api
    from serve_app.context import ApiContext

    base = tiny_model_factory("llama", seed=0)
    folders = {
        "base": base,
        "tune": tiny_model_factory("llama", seed=1, base=base),
        "wide": tiny_model_factory("llama", seed=0, hidden=64),
    }
    settings = Settings(data_dir=tmp_path_factory.mktemp("dry-run-http"))
    Database.from_settings(settings).upgrade()
    services = Services(settings)
    _, key = ApiKeyStore(services.db).create("planner", ["write", "read"])
    registry = StandInRegistry(folders, registered={"base", "tune", "wide", "taken"})
    context = ApiContext(config=ConfigHolder(settings), services=services, handles={c.MODEL_REGISTRY: registry})
    with TestClient(create_api(context), headers={"Authorization": f"Bearer {key}"}) as session:
        session.services = services
        yield session


def dry_run(client, **fields):
    body = {"models": ["base", "tune"], "strategy": "ties", "base_model": "base", "output_model_id": "out"}
    return client.post("/merge/execute", json={**body, "parameters": {"density": 0.5}, "dry_run": True, **fields})


def test_dry_run_answers_200_with_the_plan_and_creates_no_job(client):
    response = dry_run(client)
    assert response.status_code == 200, response.text
    report = response.json()
    assert report["compatibility"]["compatible"] is True
    assert report["method"] == "ties" and report["tensors"] > 0 and report["shards"]
    assert {"peak_memory_bytes", "disk_bytes", "wall_seconds"} <= set(report["estimates"])
    # the merge engine is warm: no fresh process's start (2.9 s calibrated) in a tiny merge's wall time
    assert report["estimates"]["wall_seconds"] < footprint.STARTUP_S / 2
    assert "Location" not in response.headers
    assert client.services.jobs.list().total == 0


def test_incompatible_models_are_the_verdict(client):
    response = dry_run(client, models=["base", "wide"])
    assert response.status_code == 200
    verdict = response.json()["compatibility"]
    assert verdict["compatible"] is False and verdict["code"] == "INCOMPATIBLE_MODELS"


def test_a_taken_output_id_and_a_bad_parameter_are_refused_as_for_a_submission(client):
    assert dry_run(client, output_model_id="taken").json()["error"]["code"] == "ALREADY_EXISTS"
    response = dry_run(client, parameters={"density": 7})
    assert response.status_code == 422 and response.json()["error"]["code"] == "VALIDATION_FAILED"


def test_the_report_is_typed_in_the_openapi_document(client):
    document = client.get("/openapi.json").json()
    answers = document["paths"]["/merge/execute"]["post"]["responses"]
    assert answers["200"]["content"]["application/json"]["schema"]["$ref"].endswith("/DryRunReport")
    assert "estimates" in document["components"]["schemas"]["DryRunReport"]["properties"]
    assert "dry_run" in document["components"]["schemas"]["MergeRequest"]["properties"]
