"""Schemathesis over the OpenAPI of an app wired with Alloy's error handlers and security, through real HTTP:
valid and invalid requests to every operation, with a valid key, a read-only key and no key. No 5xx, every
error well-formed (see tests/fuzz_helpers.py, reusable against the full Serve app)."""

from __future__ import annotations

import httpx
import pytest
from schemathesis import GenerationMode

from alloy.storage.db import Database
from alloy.storage.keys import ApiKeyStore
from tests.fuzz_helpers import check_response, fuzz_api
from tests.security_helpers import build_test_app, make_settings, serve_in_thread

UNLIMITED = {"read_limit": "100000/minute", "jobs_limit": "100000/minute"}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    url = f"sqlite:///{tmp_path_factory.mktemp('fuzz') / 'alloy.db'}"
    Database(url).upgrade()
    store = ApiKeyStore(Database(url))
    keys = {
        "admin": store.create("fuzzer", ["admin"], **UNLIMITED)[1],
        "read": store.create("fuzzer", ["read"], **UNLIMITED)[1],
    }
    with serve_in_thread(build_test_app(make_settings(), url)) as base_url:
        yield base_url, keys


def test_fuzz_with_admin_key(served):
    base_url, keys = served
    report = fuzz_api(base_url, keys["admin"], max_examples=25)
    assert {"GET /models/{model_id}", "POST /merge/execute", "POST /admin/flush", "POST /notes"} <= set(
        report.operations
    )
    statuses = {status for (_, status) in report.statuses}
    assert 200 in statuses and 422 in statuses, report.statuses  # both valid and invalid requests got through


def test_fuzz_with_read_only_key(served):
    base_url, keys = served
    report = fuzz_api(base_url, keys["read"], max_examples=10, modes=[GenerationMode.POSITIVE])
    assert ("POST /admin/flush", 403) in report.statuses


def test_fuzz_without_a_valid_key(served):
    base_url, _ = served
    report = fuzz_api(
        base_url,
        "alloy_0123456789abcdef_" + "A" * 43,
        max_examples=5,
        modes=[GenerationMode.POSITIVE],
        schema_with_key=False,
    )
    assert {status for (_, status) in report.statuses} == {401}


def test_check_response_rejects_malformed_errors():
    """The fuzz oracle itself can fail: a bare FastAPI-style error is caught."""
    bad = httpx.Response(
        404,
        json={"detail": "Not Found"},
        headers={"x-request-id": "r", "x-ratelimit-limit": "1", "x-ratelimit-remaining": "0", "x-ratelimit-reset": "1"},
    )
    with pytest.raises(AssertionError):
        check_response(bad, "synthetic")
    with pytest.raises(AssertionError):
        check_response(httpx.Response(502, text="bad gateway"), "synthetic")
