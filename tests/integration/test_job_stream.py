"""Following a job as a stream (what GET /jobs/{id}/events sends as SSE), on SQLite and PostgreSQL: every state
in order, progress snapshots without the heartbeat noise, one end event, resuming after a Last-Event-ID."""

from __future__ import annotations

import pytest

from alloy.errors import AlloyError, ErrorCode
from alloy.job_stream import follow, parse_last_event_id
from alloy.jobs.store import JobStore


@pytest.fixture
def jobs(database) -> JobStore:
    return JobStore(database)


def _kinds(events):
    return [(e.event, e.data.get("to_state") or e.data.get("state")) for e in events]


def test_every_state_in_order_then_end_and_nothing_after(jobs):
    job = jobs.create("merge", {})
    follower = follow(jobs, job.id)
    assert _kinds(follower.poll()) == [("state", "CREATED")]
    # Two moves between polls: both are still seen, in order.
    jobs.transition(job.id, "PREPARING")
    jobs.transition(job.id, "RUNNING", progress={"tensors_total": 4})
    assert _kinds(follower.poll()) == [("state", "PREPARING"), ("state", "RUNNING"), ("progress", "RUNNING")]
    jobs.update_progress(job.id, tensors_done=2, bytes_done=100)
    progress = follower.poll()
    assert [e.event for e in progress] == ["progress"]
    assert progress[0].data["tensors_done"] == 2 and progress[0].data["bytes_done"] == 100
    jobs.complete(job.id, {"model_id": "m"})
    last = follower.poll()
    assert _kinds(last) == [("state", "COMPLETED"), ("end", "COMPLETED")]
    assert last[-1].data["result"] == {"model_id": "m"}
    assert follower.finished and follower.poll() == []


def test_heartbeats_alone_send_nothing(jobs):
    job = jobs.create("evolution", {})
    jobs.transition(job.id, "PREPARING")
    jobs.transition(job.id, "RUNNING")
    jobs.update_progress(job.id, generation=1, best_fitness=0.5, median_fitness=0.4)
    follower = follow(jobs, job.id)
    first = follower.poll()
    assert first[-1].event == "progress" and first[-1].data["best_fitness"] == 0.5
    jobs.update_progress(job.id, heartbeat_at="2026-01-01T00:00:00+00:00")
    assert follower.poll() == []


def test_resume_skips_what_was_seen(jobs):
    job = jobs.create("merge", {})
    jobs.transition(job.id, "PREPARING")
    seen = follow(jobs, job.id).poll()
    jobs.transition(job.id, "RUNNING")
    jobs.fail(job.id, "MERGE_FAILED", "boom")
    resumed = follow(jobs, job.id, last_event_id=seen[-1].id).poll()
    assert _kinds(resumed) == [("state", "RUNNING"), ("state", "FAILED"), ("end", "FAILED")]
    assert resumed[1].data["details"] == {"code": "MERGE_FAILED", "message": "boom"}
    # Ids keep increasing across the resume, so a client's cursor always moves forward.
    ids = [int(e.id) for e in [*seen, *resumed[:-1]]]
    assert ids == sorted(set(ids))


def test_unknown_job_is_not_found_before_any_event(jobs):
    with pytest.raises(AlloyError) as caught:
        follow(jobs, "nope")
    assert caught.value.code is ErrorCode.NOT_FOUND


@pytest.mark.parametrize("value, expected", [(None, 0), ("", 0), ("7", 7), ("7.3", 7), ("x", 0), ("-1", 0)])
def test_last_event_id_parsing(value, expected):
    assert parse_last_event_id(value) == expected
