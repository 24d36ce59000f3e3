"""Schemathesis over the full Serve application of ``alloy_service`` (the real ingress, all seven deployments,
through the Serve proxy): valid and schema-violating requests to every operation of its OpenAPI document. No
5xx, and every error in the one shape with the status its code maps to (the oracle: tests/fuzz_helpers.py).

The key has the ``write`` scope, not ``admin``: admin routes are still exercised (and must answer a well-formed
403), but a fuzzed request can never drain the cluster or revoke the session's keys. Generated job requests name
models and presets that do not exist, so they are refused at once or fail as jobs without side effects.
"""

from __future__ import annotations

import pytest

from tests.fuzz_helpers import fuzz_api

pytestmark = pytest.mark.ray

UNLIMITED = {"read_limit": "100000/minute", "jobs_limit": "100000/minute"}


@pytest.fixture(scope="module")
def fuzz_key(alloy_service) -> str:
    from alloy.storage.db import Database
    from alloy.storage.keys import ApiKeyStore

    db = Database(alloy_service.database_url)
    try:
        return ApiKeyStore(db).create("fuzzer", ["write"], **UNLIMITED)[1]
    finally:
        db.close()


def test_fuzz_every_operation_of_the_serve_app(alloy_service, fuzz_key):
    report = fuzz_api(alloy_service.base_url, fuzz_key, max_examples=6)
    operations = set(report.operations)
    assert {
        "POST /merge/execute",
        "POST /evolutions",
        "POST /evaluations",
        "GET /jobs/{job_id}",
        "GET /models/{model_id}",
        "GET /health",
    } <= operations, sorted(operations)
    statuses = {status for (_, status) in report.statuses}
    assert 200 in statuses and 422 in statuses and 404 in statuses, report.statuses
    assert any(label.startswith("POST /admin") and status == 403 for (label, status) in report.statuses)
    assert report.requests >= 3 * len(operations), report.requests
