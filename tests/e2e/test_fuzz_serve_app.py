"""``schemathesis run`` over the whole Serve app of ``alloy_service`` (the real ingress, all seven deployments,
through the Serve proxy), as CI runs it (config: tests/e2e/schemathesis.toml; driver and oracle:
tests/fuzz_helpers.py).

Every built-in check (no 5xx, no status the operation does not document, response schemas and headers, negative
data refused, positive data accepted, 405 with ``Allow``, auth not ignored, use after free, ...) plus the
project's error-envelope oracle, on positive and negative data, in the examples, coverage, fuzzing and stateful
phases; the stateful phase follows the document's OpenAPI links (a 202 from ``POST /merge/execute`` to
``GET /jobs/{job_id}``, a 201 from ``POST /models`` to its ``GET`` and ``DELETE``, ...). A hook turns a few
of its valid merge and registration bodies into ones naming two models of its own and folders it may register
(tests/fuzz_helpers.py: map_body), so that 202 and 201 happen and their links lead somewhere; it never learns
the ids of the session's other models (inferred links and response-mined data are off), and the test checks
they are all still there.

Deterministic: a fixed seed, one worker, no example database. Time: about 2 minutes on this machine (the run
is bounded by its example counts; the subprocess by ``FUZZ_TIMEOUT_S``).
"""

from __future__ import annotations

import time

import pytest

from tests.fuzz_helpers import FuzzFixtures, run_schemathesis

pytestmark = pytest.mark.ray

UNLIMITED = {"read_limit": "100000/minute", "jobs_limit": "100000/minute"}
FUZZ_TIMEOUT_S = 420
FUZZ_MODELS = ("fuzz-a", "fuzz-b")


@pytest.fixture(scope="module")
def fuzz_key(alloy_service) -> str:
    """An admin key (the admin routes are fuzzed too: on this one-node cluster a drain is refused, a reload only
    bumps the version, and the run cannot learn the ids of keys it did not create)."""
    from alloy.storage.db import Database
    from alloy.storage.keys import ApiKeyStore

    db = Database(alloy_service.database_url)
    try:
        return ApiKeyStore(db).create("fuzzer", ["admin"], **UNLIMITED)[1]
    finally:
        db.close()


@pytest.fixture(scope="module")
def fuzz_sources(alloy_service, tiny_family) -> list[str]:
    base, tunes = tiny_family
    for model_id, path in zip(FUZZ_MODELS, tunes):
        if alloy_service.client("read").get(f"/models/{model_id}").status_code == 404:
            alloy_service.register_model(model_id, path)
    return [str(base), str(tunes[2])]


def _registered(alloy_service) -> set[str]:
    client = alloy_service.client("read")
    return {m["id"] for m in client.get("/models", params={"limit": 500}).json()["items"]}


def test_schemathesis_over_the_whole_serve_app(alloy_service, served_models, fuzz_key, fuzz_sources, tmp_path):
    before = _registered(alloy_service) - set(FUZZ_MODELS)
    started = time.monotonic()
    run = run_schemathesis(
        alloy_service.base_url,
        fuzz_key,
        tmp_path,
        fixtures=FuzzFixtures(models=list(FUZZ_MODELS), sources=fuzz_sources),
        timeout_s=FUZZ_TIMEOUT_S,
    )
    elapsed = time.monotonic() - started
    assert run.returncode == 0, run.output[-30000:]
    print(f"schemathesis: {sum(run.statuses.values())} responses in {elapsed:.0f} s")

    operations = {op for op, _ in run.statuses}
    assert {
        "POST /merge/execute",
        "GET /jobs/{job_id}",
        "POST /models",
        "DELETE /models/{model_id}",
        "POST /admin/drain",
        "GET /health",
    } <= operations, sorted(operations)
    assert not [key for key in run.statuses if key[1] >= 500], run.statuses
    statuses = {status for _, status in run.statuses}
    assert {200, 201, 202, 204, 404, 405, 409, 422} <= statuses, sorted(statuses)
    # The hook's valid bodies got through, and the links from what they created were followed.
    for reached in [
        ("POST /merge/execute", 202),
        ("GET /jobs/{job_id}", 200),
        ("POST /models", 201),
        ("DELETE /models/{model_id}", 204),
    ]:
        assert run.statuses[reached], reached
    assert run.report["phases"]["stateful"]["status"] == "success", run.report["phases"]
    assert before <= _registered(alloy_service)  # the session's models are all still there
    for job in _fuzzer_jobs(alloy_service):  # every merge the run started ends well
        final = alloy_service.wait_job(job)
        assert final["state"] == "COMPLETED", final


def _fuzzer_jobs(alloy_service) -> list[str]:
    from alloy.jobs.store import JobStore
    from alloy.storage.db import Database

    db = Database(alloy_service.database_url)
    try:
        jobs = JobStore(db).list(owner="fuzzer", limit=500).items
    finally:
        db.close()
    return [f"{alloy_service.base_url}/jobs/{job.id}" for job in jobs]
