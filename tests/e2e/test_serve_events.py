"""GET /jobs/{id}/events through the real Serve proxy: the live Server-Sent Events of a merge show every state in
order and end with the job; Last-Event-ID resumes after what was seen; without the SSE Accept header the same
path answers the JSON history; errors come as JSON before any stream opens; the OpenAPI document says so."""

from __future__ import annotations

import json

import httpx
import pytest
from httpx_sse import connect_sse

pytestmark = pytest.mark.ray

EXPECTED_MERGE_STATES = ["CREATED", "PREPARING", "RUNNING", "COMPLETED"]


def _start_merge(service, output: str) -> str:
    response = service.client("write").post(
        "/merge/execute",
        json={
            "models": ["tune1", "tune2"],
            "strategy": "ties",
            "base_model": "base",
            "parameters": {"density": 0.5},
            "output_model_id": output,
        },
    )
    assert response.status_code == 202, response.text
    return response.json()["job_id"]


def _read_stream(client, job_id: str, **headers: str) -> list:
    with connect_sse(client, "GET", f"/jobs/{job_id}/events", headers=headers) as source:
        assert source.response.status_code == 200
        assert source.response.headers["content-type"].startswith("text/event-stream")
        return list(source.iter_sse())


def test_merge_stream_shows_every_state_in_order_then_ends(alloy_service, served_models):
    job_id = _start_merge(alloy_service, "sse-merged")
    events = _read_stream(alloy_service.client("read", timeout=240.0), job_id)
    states = [json.loads(e.data)["to_state"] for e in events if e.event == "state"]
    assert states == EXPECTED_MERGE_STATES
    assert events[-1].event == "end"
    final = json.loads(events[-1].data)
    assert final["state"] == "COMPLETED" and final["model_id"] == "sse-merged" and final["percent"] == 100.0
    assert final["progress_url"].endswith(f"/jobs/{job_id}")  # the public view, as GET /jobs/{id} answers
    # Ids increase, so a reconnecting client's Last-Event-ID is a cursor.
    state_ids = [int(e.id) for e in events if e.event == "state"]
    assert state_ids == sorted(set(state_ids))
    for progress in (json.loads(e.data) for e in events if e.event == "progress"):
        assert progress["job_id"] == job_id and "heartbeat_at" not in progress


def test_resume_with_last_event_id_skips_what_was_seen(alloy_service, served_models):
    job_id = _start_merge(alloy_service, "sse-resumed")
    client = alloy_service.client("read", timeout=240.0)
    first = _read_stream(client, job_id)
    state_events = [e for e in first if e.event == "state"]
    seen = state_events[1]  # as if the connection dropped after PREPARING
    resumed = _read_stream(client, job_id, **{"Last-Event-ID": seen.id})
    assert [json.loads(e.data)["to_state"] for e in resumed if e.event == "state"] == EXPECTED_MERGE_STATES[2:]
    assert resumed[-1].event == "end"


def test_without_event_stream_accept_the_history_is_json(alloy_service, served_models):
    job_id = _start_merge(alloy_service, "sse-history")
    alloy_service.wait_job(f"{alloy_service.base_url}/jobs/{job_id}")
    response = alloy_service.client("read").get(f"/jobs/{job_id}/events")
    assert response.status_code == 200 and response.headers["content-type"].startswith("application/json")
    assert [e["to_state"] for e in response.json()] == EXPECTED_MERGE_STATES


def test_errors_are_json_before_any_stream(alloy_service):
    stream = {"Accept": "text/event-stream"}
    unknown = alloy_service.client("read").get("/jobs/no-such-job/events", headers=stream)
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "NOT_FOUND"
    anonymous = alloy_service.client(None).get("/jobs/no-such-job/events", headers=stream)
    assert anonymous.status_code == 401 and anonymous.json()["error"]["code"] == "UNAUTHENTICATED"


def test_openapi_documents_the_stream_and_its_statuses(alloy_service):
    spec = alloy_service.client(None).get("/openapi.json").json()
    operation = spec["paths"]["/jobs/{job_id}/events"]["get"]
    assert "text/event-stream" in operation["responses"]["200"]["content"]
    assert {"200", "401", "403", "404", "429", "503"} <= set(operation["responses"])
    assert any(p["name"] == "last-event-id" for p in operation["parameters"])


def test_a_stream_counts_once_against_the_rate_limit(alloy_service, served_models):
    from alloy.storage.db import Database
    from alloy.storage.keys import ApiKeyStore

    db = Database(alloy_service.database_url)
    try:
        _, key = ApiKeyStore(db).create("sse-limited", ["read"], read_limit="20/minute")
    finally:
        db.close()
    job_id = _start_merge(alloy_service, "sse-limited")
    remaining = []
    with httpx.Client(
        base_url=alloy_service.base_url, headers={"Authorization": f"Bearer {key}"}, timeout=240.0
    ) as client:
        for _ in range(2):
            with connect_sse(client, "GET", f"/jobs/{job_id}/events") as source:
                remaining.append(int(source.response.headers["x-ratelimit-remaining"]))
                events = list(source.iter_sse())  # however many events and pings, the stream is one request
            assert events[-1].event == "end"
    assert remaining == [19, 18]
