"""The error mechanism over real HTTP, without Ray: an INTERNAL_ERROR planted with a path and SQL in its text
reaches the client as the generic message (the text is in the log under the request id); a 405's Allow lists
every method of the path; behind the Serve proxy the proxy's id is the only X-Request-ID, whatever it is."""

from __future__ import annotations

import logging

import httpx
import pytest
from fastapi import FastAPI

from alloy.errors import AlloyError, ErrorCode
from alloy.storage.db import Database
from alloy.storage.keys import ApiKeyStore
from tests.integration.test_security_http import assert_error
from tests.security_helpers import build_test_app, make_settings, serve_in_thread

PLANTED = "(psycopg.errors.UniqueViolation) INSERT INTO models VALUES ... -- /var/lib/alloy/artifacts/models/x"


def _app_with_plants(url: str) -> FastAPI:
    app = build_test_app(make_settings(), url)

    @app.get("/planted")
    def planted() -> None:
        raise AlloyError(ErrorCode.INTERNAL_ERROR, PLANTED, {"sql": "INSERT INTO models"})

    @app.delete("/models/{model_id}")
    def delete_model(model_id: str) -> None:
        return None

    return app


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    url = f"sqlite:///{tmp_path_factory.mktemp('contract') / 'alloy.db'}"
    Database(url).upgrade()
    key = ApiKeyStore(Database(url)).create("tester", ["admin"])[1]
    with serve_in_thread(_app_with_plants(url)) as base_url:
        yield base_url, key


@pytest.fixture
def client(served):
    base_url, key = served
    with httpx.Client(base_url=base_url, headers={"Authorization": f"Bearer {key}"}, timeout=10) as session:
        yield session


def test_a_planted_internal_error_reaches_the_client_without_its_text(client, caplog):
    caplog.set_level(logging.WARNING, logger="alloy.http")
    response = client.get("/planted", headers={"X-Request-ID": "plant-1"})
    error = assert_error(response, 500, "INTERNAL_ERROR")
    assert error == {
        "code": "INTERNAL_ERROR",
        "message": "internal error; the server log has the details under reference plant-1",
        "details": {},
        "request_id": "plant-1",
    }
    for leaked in ("psycopg", "INSERT", "/var/lib"):
        assert leaked not in response.text
    assert any("plant-1" in r.getMessage() and PLANTED in r.getMessage() for r in caplog.records)


def test_a_405_allow_lists_every_method_of_the_path(client):
    response = client.post("/models/some-model")
    assert_error(response, 405, "METHOD_NOT_ALLOWED")
    assert response.headers.get_list("allow") == ["GET, DELETE"]  # Starlette alone says "GET"


def test_behind_the_proxy_its_id_is_the_only_one_even_when_it_is_not_a_plain_token():
    """Serve's proxy echoes whatever X-Request-ID the client sent; the body must repeat that, not a new id."""
    from ray.serve._private.http_util import RequestIdMiddleware

    from serve_app.errors import install_error_handlers

    app = FastAPI()
    install_error_handlers(app, behind_serve_proxy=True)
    proxied = FastAPI()
    proxied.mount("/", RequestIdMiddleware(app))
    with serve_in_thread(proxied) as url:
        for sent in ("a b<c>", "x" * 300):
            response = httpx.get(url + "/missing", headers={"X-Request-ID": sent})
            ids = response.headers.get_list("x-request-id")
            assert ids == [sent] and response.json()["error"]["request_id"] == sent
