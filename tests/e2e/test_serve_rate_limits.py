"""Per-key rate limits hold across Serve ingress replicas: the session app runs two Ingress replicas that share
their counters through Redis, and concurrent clients through the Serve proxy get exactly the limit."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.fixtures.service import INGRESS_REPLICAS

pytestmark = pytest.mark.ray


def running_ingress_replicas() -> int:
    from ray import serve

    deployment = serve.status().applications["alloy"].deployments["Ingress"]
    return deployment.replica_states.get("RUNNING", 0)


def key_with_job_limit(alloy_service, limit: str) -> str:
    from alloy.storage.db import Database
    from alloy.storage.keys import ApiKeyStore

    db = Database(alloy_service.database_url)
    try:
        _, plaintext = ApiKeyStore(db).create("limits-test", ["write"], jobs_limit=limit, read_limit="100000/minute")
        return plaintext
    finally:
        db.close()


def test_exactly_the_job_limit_is_admitted_across_two_ingress_replicas(alloy_service):
    assert running_ingress_replicas() == INGRESS_REPLICAS == 2
    key = key_with_job_limit(alloy_service, "10/minute")
    # An invalid merge (one model) is refused after the limiter counted it: 422 means admitted, 429 refused.
    body = {"models": ["only-one"], "strategy": "ties", "output_model_id": "never-made"}

    def submit(_: int) -> httpx.Response:
        with httpx.Client(base_url=alloy_service.base_url, timeout=60.0) as client:
            return client.post("/merge/execute", json=body, headers={"Authorization": f"Bearer {key}"})

    with ThreadPoolExecutor(max_workers=15) as pool:
        responses = list(pool.map(submit, range(30)))

    statuses = sorted(r.status_code for r in responses)
    assert statuses == [422] * 10 + [429] * 20, statuses
    refused = [r for r in responses if r.status_code == 429]
    assert all(r.json()["error"]["code"] == "QUOTA_EXCEEDED" for r in refused)
    assert all(int(r.headers["Retry-After"]) >= 1 for r in refused)
    assert all(r.headers["X-RateLimit-Limit"] == "10" for r in responses)
    assert {r.headers["X-RateLimit-Remaining"] for r in refused} == {"0"}
