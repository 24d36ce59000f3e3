"""The one error shape over real HTTP: Alloy errors, FastAPI validation, unknown routes, wrong methods,
crashes (no internals leak) and request ids."""

from __future__ import annotations

import logging

import httpx
import pytest

from alloy.errors import HTTP_STATUS, ErrorCode
from alloy.storage.db import Database
from alloy.storage.keys import ApiKeyStore
from tests.integration.test_security_http import assert_error
from tests.security_helpers import build_test_app, make_settings, serve_in_thread


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    url = f"sqlite:///{tmp_path_factory.mktemp('errors') / 'alloy.db'}"
    Database(url).upgrade()
    key = ApiKeyStore(Database(url)).create("tester", ["admin"])[1]
    with serve_in_thread(build_test_app(make_settings(), url)) as base_url:
        yield base_url, key


@pytest.fixture
def client(served):
    base_url, key = served
    with httpx.Client(base_url=base_url, headers={"Authorization": f"Bearer {key}"}, timeout=10) as session:
        yield session


def test_alloy_error_keeps_its_code_and_status(client):
    error = assert_error(client.get("/models/missing"), 404, "MODEL_NOT_FOUND")
    assert error["details"] == {"model_id": "missing"}


def test_validation_errors_name_each_field(client):
    response = client.post("/merge/execute", json={"models": ["only-one"], "strategy": "blend", "output_model": "../x"})
    error = assert_error(response, 422, "VALIDATION_FAILED")
    fields = {item["field"] for item in error["details"]["errors"]}
    assert fields == {"body.models", "body.strategy", "body.output_model"}
    assert all(set(item) == {"field", "message", "type"} for item in error["details"]["errors"])
    assert "../x" not in response.text  # inputs are not echoed back


@pytest.mark.parametrize("model_id", ["a..b", "-leading-dash", "x" * 200, "bad%20space"])
def test_invalid_resource_ids_in_paths_are_422(client, model_id):
    assert_error(client.get(f"/models/{model_id}"), 422, "VALIDATION_FAILED")


def test_malformed_json_is_422(client):
    response = client.post("/merge/execute", content=b"{not json", headers={"Content-Type": "application/json"})
    assert_error(response, 422, "VALIDATION_FAILED")


def test_unknown_route_is_404_not_found(client):
    error = assert_error(client.get("/no/such/route"), 404, "NOT_FOUND")
    assert "/no/such/route" in error["message"]


def test_wrong_method_is_405(client):
    response = client.delete("/merge/execute")
    assert_error(response, 405, "METHOD_NOT_ALLOWED")
    assert "POST" in response.headers["allow"]


def test_crash_is_500_without_internals(client, caplog):
    caplog.set_level(logging.ERROR, logger="alloy.http")
    response = client.get("/crash", headers={"X-Request-ID": "trace-500"})
    error = assert_error(response, 500, "INTERNAL_ERROR")
    assert error["request_id"] == "trace-500" and error["details"] == {}
    for leaked in ("hunter2", "RuntimeError", "/var/lib", "Traceback"):
        assert leaked not in response.text
    logged = [r for r in caplog.records if "trace-500" in r.getMessage()]
    assert logged and logged[0].exc_info is not None  # the detail is in the server log, under the request id


def test_request_id_is_honoured_or_replaced(client):
    first, second = client.get("/models/m"), client.get("/models/m")
    assert first.headers["x-request-id"] != second.headers["x-request-id"]  # generated per request
    assert client.get("/models/m", headers={"X-Request-ID": "abc-123"}).headers["x-request-id"] == "abc-123"
    unsafe = client.get("/nowhere", headers={"X-Request-ID": "a b<script>" + "x" * 200})
    error = assert_error(unsafe, 404, "NOT_FOUND")
    assert error["request_id"] != "a b<script>" + "x" * 200 and len(error["request_id"]) == 32


def test_openapi_declares_the_error_shape(client):
    schema = client.get("/openapi.json").json()
    assert "ErrorResponse" in schema["components"]["schemas"]
    responses = schema["paths"]["/merge/execute"]["post"]["responses"]
    for status in ("401", "403", "404", "413", "422", "429", "500"):
        assert responses[status]["content"]["application/json"]["schema"] == {
            "$ref": "#/components/schemas/ErrorResponse"
        }


def test_every_code_has_one_documented_status():
    """The API reference's error table lists every code with the status alloy.errors assigns it."""
    from pathlib import Path

    table = (Path(__file__).resolve().parents[2] / "docs" / "API.md").read_text()
    for code, status in HTTP_STATUS.items():
        assert f"| `{code.value}` | {status} |" in table, code
    assert len(HTTP_STATUS) == len(ErrorCode)


def test_behind_the_serve_proxy_there_is_one_request_id():
    """Ray Serve's proxy adds X-Request-ID to every request and response itself (its RequestIdMiddleware, applied
    here exactly as the proxy applies it); with behind_serve_proxy=True the body's request_id is that same id
    and the response carries exactly one X-Request-ID."""
    from fastapi import FastAPI
    from ray.serve._private.http_util import RequestIdMiddleware

    from serve_app.errors import install_error_handlers

    app = FastAPI()
    install_error_handlers(app, behind_serve_proxy=True)
    proxied = FastAPI()
    proxied.mount("/", RequestIdMiddleware(app))
    with serve_in_thread(proxied) as url:
        for headers in ({}, {"X-Request-ID": "client-chosen id"}):
            response = httpx.get(url + "/missing", headers=headers)
            assert response.status_code == 404
            ids = response.headers.get_list("x-request-id")
            assert len(ids) == 1 and response.json()["error"]["request_id"] == ids[0]
            if headers:
                assert ids[0] == "client-chosen id"
