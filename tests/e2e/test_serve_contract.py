"""The HTTP contract of the Serve app, through the proxy: input that used to crash it is refused with the right
4xx, the OpenAPI document declares every status an operation answers (and links what a 202 creates to where it
is read), one X-Request-ID per response that the error body repeats, a 405 that lists every method of the path,
and what can be checked before a merge job exists is checked before."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.ray

HUGE = 9223372036854775808  # 2**63: past SQLite's integers


@pytest.mark.parametrize("path", ["/models", "/jobs", "/datasets", "/experiments"])
def test_an_offset_past_every_integer_is_422(alloy_service, path):
    response = alloy_service.client("read").get(path, params={"offset": HUGE})
    assert response.status_code == 422, response.text
    assert response.json()["error"]["code"] == "VALIDATION_FAILED"


@pytest.mark.parametrize(
    "path, body",
    [
        ("/models", {"model_id": "nul-model", "source": "/tmp/a\x00b"}),
        ("/models", {"model_id": "long-model", "source": "/tmp/" + "x" * 300}),  # past NAME_MAX
        ("/datasets", {"dataset_id": "nul-data", "source": "/tmp/a\x00b.jsonl"}),
        ("/datasets", {"dataset_id": "ctl-data", "source": "/tmp/a.jsonl", "task": {"type": "x\x1b[31m"}}),
        ("/models", {"model_id": "ctl-model", "source": "/tmp/x", "lineage": {"note": "a\x00"}}),
    ],
)
def test_control_characters_and_overlong_names_are_422(alloy_service, path, body):
    response = alloy_service.client("write").post(path, json=body)
    assert response.status_code == 422, response.text
    assert response.json()["error"]["code"] == "VALIDATION_FAILED"


def test_a_405_lists_every_method_of_the_path(alloy_service, served_models):
    client = alloy_service.client("write")
    for method, path, allowed in [
        ("POST", "/models/tune1", "GET, DELETE"),
        ("PUT", "/models", "GET, POST"),
        ("DELETE", "/merge/execute", "POST"),
    ]:
        response = client.request(method, path)
        assert response.status_code == 405 and response.json()["error"]["code"] == "METHOD_NOT_ALLOWED"
        assert response.headers.get_list("allow") == [allowed], (method, path)


@pytest.mark.parametrize("sent", [None, "client-trace.1", "a b<c>"])
def test_one_request_id_the_body_and_the_header_agree_on(alloy_service, sent):
    """The proxy's id wins (the client's, as sent, or a new one): exactly one header, the same in the body."""
    headers = {"X-Request-ID": sent} if sent else {}
    response = alloy_service.client("read").get("/jobs/no-such-job", headers=headers)
    ids = response.headers.get_list("x-request-id")
    assert len(ids) == 1, ids
    assert response.json()["error"]["request_id"] == ids[0]
    if sent:
        assert ids[0] == sent


def _jobs_total(alloy_service) -> int:
    return alloy_service.client("read").get("/jobs", params={"limit": 1}).json()["total"]


def test_a_franken_slice_past_the_models_layers_is_refused_before_a_job_exists(alloy_service, served_models):
    before = _jobs_total(alloy_service)
    body = {
        "models": ["tune1", "tune2"],
        "strategy": "franken_merge",
        "output_model_id": "never-stacked",
        "slices": [{"model": "tune1", "layer_range": [0, 1]}, {"model": "tune2", "layer_range": [1, 40]}],
    }
    response = alloy_service.client("write").post("/merge/execute", json=body)
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["code"] == "VALIDATION_FAILED" and "layer_range" in error["message"]
    assert _jobs_total(alloy_service) == before


def test_an_output_id_equal_to_an_input_is_409_already_exists(alloy_service, served_models):
    body = {"models": ["tune1", "tune2"], "strategy": "slerp", "output_model_id": "tune1"}
    response = alloy_service.client("write").post("/merge/execute", json=body)
    assert response.status_code == 409, response.text
    assert response.json()["error"]["code"] == "ALREADY_EXISTS"


def test_the_openapi_document_declares_every_status_and_the_links(alloy_service):
    document = alloy_service.client(None).get("/openapi.json").json()
    operations = {
        (method.upper(), path): operation
        for path, item in document["paths"].items()
        for method, operation in item.items()
        if isinstance(operation, dict) and "responses" in operation
    }
    for key, operation in operations.items():
        for status in ("401", "403", "404", "405", "413", "422", "429", "500", "503"):
            content = operation["responses"][status]["content"]["application/json"]["schema"]
            assert content == {"$ref": "#/components/schemas/ErrorResponse"}, (key, status)
    for key in [
        ("POST", "/merge/execute"),
        ("POST", "/models"),
        ("POST", "/datasets"),
        ("POST", "/admin/drain"),
        ("GET", "/evaluations/{job_id}/results"),
    ]:
        assert "409" in operations[key]["responses"], key
    links = operations[("POST", "/merge/execute")]["responses"]["202"]["links"]
    assert links["GetJob"]["parameters"] == {"job_id": "$response.body#/job_id"}
    assert links["GetJob"]["operationId"] == operations[("GET", "/jobs/{job_id}")]["operationId"]


def test_an_internal_error_reaches_clients_without_internals(alloy_service):
    """Planted: a job that crashed with a driver's message (a server path and SQL). GET /jobs/{id} and its
    events show the generic message with the job id as the reference; the text itself is in the log only."""
    from alloy.errors import ErrorCode
    from alloy.jobs.records import JobKind
    from alloy.jobs.store import JobStore
    from alloy.storage.db import Database

    db = Database(alloy_service.database_url)
    try:
        jobs = JobStore(db)
        job = jobs.create(JobKind.EVALUATION, {"models": ["m"], "datasets": ["d"]})
        planted = "(sqlite3.OperationalError) no such table: SELECT * FROM jobs -- /srv/alloy/var/alloy.db"
        jobs.fail(job.id, ErrorCode.INTERNAL_ERROR, planted)
    finally:
        db.close()
    reader = alloy_service.client("read")
    view = reader.get(f"/jobs/{job.id}").json()
    assert view["error"] == {
        "code": "INTERNAL_ERROR",
        "message": f"internal error; the server log has the details under reference {job.id}",
    }
    events = reader.get(f"/jobs/{job.id}/events").text
    assert "sqlite3" not in events and "/srv/alloy" not in events and "SELECT" not in events


def test_a_last_event_id_past_every_integer_is_422(alloy_service):
    from alloy.jobs.records import JobKind
    from alloy.jobs.store import JobStore
    from alloy.storage.db import Database

    db = Database(alloy_service.database_url)
    try:
        job = JobStore(db).create(JobKind.EVALUATION, {})
        JobStore(db).fail(job.id, "CANCELLED", "only its history is read")
    finally:
        db.close()
    headers = {"Accept": "text/event-stream", "Last-Event-ID": "9" * 30}
    response = alloy_service.client("read").get(f"/jobs/{job.id}/events", headers=headers)
    assert response.status_code == 422, response.text
    assert response.json()["error"]["code"] == "VALIDATION_FAILED"
