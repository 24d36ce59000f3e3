"""The HTTP face of recipes: ``strategy`` is exactly one of the five families, ``variant`` picks a method of
that family (an enum in the OpenAPI schema), ``GET /methods`` lists the catalogue. The real FastAPI app over a
real SQLite database; no Ray (every answer here comes before a deployment is called)."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from alloy.config import ConfigHolder, Settings
from alloy.storage.db import Database
from alloy.storage.keys import ApiKeyStore
from kernels.registry import METHODS


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    from deployments.runtime import Services
    from serve_app.api import create_api
    from serve_app.context import ApiContext

    settings = Settings(data_dir=tmp_path_factory.mktemp("merge-http"))
    Database.from_settings(settings).upgrade()
    services = Services(settings)
    _, key = ApiKeyStore(services.db).create("recipes", ["write"])
    context = ApiContext(config=ConfigHolder(settings), services=services)
    with TestClient(create_api(context), headers={"Authorization": f"Bearer {key}"}) as session:
        yield session


def merge(client, **fields):
    body = {"models": ["a", "b"], "strategy": "ties", "output_model_id": "out", **fields}
    return client.post("/merge/execute", json=body)


@pytest.mark.parametrize("strategy", ["linear", "dare_ties", "passthrough", "magic"])
def test_strategy_outside_the_five_is_422_invalid_strategy(client, strategy):
    response = merge(client, strategy=strategy)
    assert response.status_code == 422
    assert response.json()["error"]["code"] == "INVALID_STRATEGY"


def test_variant_of_another_family_is_invalid_strategy(client):
    response = merge(client, strategy="ties", variant="dare_linear")
    assert response.status_code == 422 and response.json()["error"]["code"] == "INVALID_STRATEGY"


def test_unknown_variant_is_refused_by_the_schema(client):
    response = merge(client, strategy="ties", variant="frobnicate")
    assert response.status_code == 422 and response.json()["error"]["code"] == "VALIDATION_FAILED"


def test_variant_is_an_enum_of_every_method_in_the_openapi_schema(client):
    schema = client.get("/openapi.json").json()["components"]["schemas"]["MergeRequest"]["properties"]["variant"]
    enums = [option.get("enum") for option in schema.get("anyOf", [schema]) if option.get("enum")]
    assert enums and set(enums[0]) == set(METHODS)


def test_methods_lists_every_method_with_family_and_parameters(client):
    response = client.get("/methods")
    assert response.status_code == 200
    by_name = {m["name"]: m for m in response.json()}
    assert set(by_name) == set(METHODS)
    assert by_name["dare_ties"]["family"] == "dare" and by_name["passthrough"]["family"] == "franken_merge"
    density = next(p for p in by_name["ties"]["parameters"] if p["name"] == "density")
    assert (density["default"], density["minimum"], density["maximum"], density["scope"]) == (
        1.0,
        0.0,
        1.0,
        "per_model",
    )
    weight = next(p for p in by_name["linear"]["parameters"] if p["name"] == "weight")
    assert weight["required"] is True


def test_cli_methods_lists_the_same_catalogue():
    from click.testing import CliRunner

    from alloy.cli.main import cli

    outcome = CliRunner().invoke(cli, ["methods", "--family", "ties"])
    assert outcome.exit_code == 0, outcome.output
    assert (
        "della  [ties]" in outcome.output and "epsilon (float, per_model) in [0.0, 0.5], default 0.15" in outcome.output
    )
    assert "dare_ties" not in outcome.output
