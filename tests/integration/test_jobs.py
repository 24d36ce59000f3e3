"""JobStore state machine, compare-and-set and replay history, on SQLite and PostgreSQL."""

from __future__ import annotations

import threading

import pytest
from sqlalchemy.exc import SQLAlchemyError

from alloy.errors import AlloyError, ErrorCode
from alloy.jobs.records import JobState
from alloy.jobs.store import JobStore


@pytest.fixture
def jobs(database) -> JobStore:
    return JobStore(database)


def test_create_starts_in_created(jobs):
    job = jobs.create("merge", {"models": ["a", "b"]}, owner="alice")
    assert job.state is JobState.CREATED and job.request == {"models": ["a", "b"]}
    assert job.owner == "alice" and job.error is None and job.created_at.tzinfo is not None
    assert jobs.get(job.id) == job


def test_full_legal_path_with_progress_and_result(jobs):
    job = jobs.create("merge", {})
    jobs.transition(job.id, JobState.PREPARING)
    running = jobs.transition(job.id, "RUNNING", progress={"tensors_total": 10})
    assert running.started_at is not None and running.finished_at is None
    jobs.update_progress(job.id, tensors_done=5, percent=50.0)
    assert jobs.get(job.id).progress == {"tensors_total": 10, "tensors_done": 5, "percent": 50.0}
    jobs.transition(job.id, JobState.EVALUATING)
    done = jobs.complete(job.id, {"model_id": "merged"})
    assert done.state is JobState.COMPLETED and done.result == {"model_id": "merged"}
    assert done.progress["percent"] == 100.0 and done.finished_at is not None
    assert [e.to_state for e in jobs.events(job.id)] == [
        JobState.CREATED,
        JobState.PREPARING,
        JobState.RUNNING,
        JobState.EVALUATING,
        JobState.COMPLETED,
    ]


def test_running_may_complete_without_evaluating(jobs):
    job = jobs.create("evaluation", {})
    jobs.transition(job.id, "PREPARING")
    jobs.transition(job.id, "RUNNING")
    assert jobs.complete(job.id, {}).state is JobState.COMPLETED


@pytest.mark.parametrize(
    "path, illegal",
    [
        ([], "RUNNING"),
        ([], "COMPLETED"),
        (["PREPARING"], "EVALUATING"),
        (["PREPARING", "RUNNING"], "PREPARING"),
        (["PREPARING", "RUNNING"], "CREATED"),
        (["FAILED"], "PREPARING"),
    ],
)
def test_illegal_moves_are_conflicts(jobs, path, illegal):
    job = jobs.create("merge", {})
    for state in path:
        jobs.transition(job.id, state) if state != "FAILED" else jobs.fail(job.id, "INTERNAL_ERROR", "x")
    with pytest.raises(AlloyError) as caught:
        jobs.transition(job.id, illegal)
    assert caught.value.code is ErrorCode.CONFLICT


def test_fail_from_any_non_terminal_state_records_the_error(jobs):
    for path in ([], ["PREPARING"], ["PREPARING", "RUNNING"], ["PREPARING", "RUNNING", "EVALUATING"]):
        job = jobs.create("merge", {})
        for state in path:
            jobs.transition(job.id, state)
        failed = jobs.fail(job.id, ErrorCode.INCOMPATIBLE_MODELS, "shapes differ")
        assert failed.state is JobState.FAILED
        assert failed.error.model_dump() == {"code": "INCOMPATIBLE_MODELS", "message": "shapes differ"}
    with pytest.raises(AlloyError) as caught:
        jobs.fail(job.id, "INTERNAL_ERROR", "twice")
    assert caught.value.code is ErrorCode.CONFLICT


def test_progress_after_completion_is_a_conflict(jobs):
    job = jobs.create("merge", {})
    jobs.fail(job.id, "INTERNAL_ERROR", "gone")
    with pytest.raises(AlloyError) as caught:
        jobs.update_progress(job.id, percent=10)
    assert caught.value.code is ErrorCode.CONFLICT


def test_unknown_job_is_not_found(jobs):
    for call in (lambda: jobs.get("nope"), lambda: jobs.transition("nope", "PREPARING"), lambda: jobs.events("nope")):
        with pytest.raises(AlloyError) as caught:
            call()
        assert caught.value.code is ErrorCode.NOT_FOUND


def test_duplicate_job_id_and_bad_kind(jobs):
    jobs.create("merge", {}, job_id="job-1")
    with pytest.raises(AlloyError) as caught:
        jobs.create("merge", {}, job_id="job-1")
    assert caught.value.code is ErrorCode.ALREADY_EXISTS
    with pytest.raises(AlloyError) as caught:
        jobs.create("training", {})
    assert caught.value.code is ErrorCode.VALIDATION_FAILED


def test_concurrent_compare_and_set_has_exactly_one_winner(jobs):
    rounds, outcomes = 6, []
    for _ in range(rounds):
        job = jobs.create("merge", {})
        barrier = threading.Barrier(2)
        results: list[str] = []

        def race(job=job, barrier=barrier, results=results):
            barrier.wait()
            try:
                jobs.transition(job.id, JobState.PREPARING)
                results.append("won")
            except AlloyError as exc:
                results.append(exc.code.value)

        threads = [threading.Thread(target=race) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        outcomes.append(sorted(results))
        assert [e.to_state for e in jobs.events(job.id)].count(JobState.PREPARING) == 1
    assert outcomes == [["CONFLICT", "won"]] * rounds


def test_concurrent_progress_writes_and_moves_lose_no_key(jobs):
    """Heartbeat threads and the job's own progress writer merge into the same JSON: neither may write back a
    stale copy over the other's keys (the lost update once dropped an evolution's last candidate count), none may
    give up on a busy row (a lost compare-and-set once did, under a loaded CI machine), and a move racing them
    keeps every key too."""
    job = jobs.create("evolution", {})
    jobs.transition(job.id, JobState.PREPARING)
    jobs.transition(job.id, JobState.RUNNING)
    keys = ("trials", "heartbeat", "other", "best", "generation", "candidates", "tensors_done", "bytes_done")
    writes, stale, errors = 80, [], []

    def writer(key: str) -> None:
        try:
            for value in range(1, writes + 1):
                seen = jobs.update_progress(job.id, **{key: value}).progress
                if seen.get(key, 0) < value:  # read back after the write: an overwrite already took it away
                    stale.append((key, value, seen.get(key)))
        except (AlloyError, SQLAlchemyError) as error:  # a thread's exception would otherwise only be a warning
            errors.append((key, repr(error)))

    threads = [threading.Thread(target=writer, args=(key,)) for key in keys]
    for thread in threads:
        thread.start()
    evaluating = jobs.transition(job.id, JobState.EVALUATING, progress={"stage": "test"})
    for thread in threads:
        thread.join(120)
    assert not any(thread.is_alive() for thread in threads)
    assert errors == [] and stale == []
    assert evaluating.state is JobState.EVALUATING
    final = jobs.complete(job.id, {}).progress
    assert {key: final[key] for key in keys} == dict.fromkeys(keys, writes)
    assert final["stage"] == "test" and final["percent"] == 100.0


def test_requeue_records_interruption_and_replay(jobs):
    job = jobs.create("evolution", {"generations": 3})
    jobs.transition(job.id, "PREPARING")
    jobs.transition(job.id, "RUNNING")
    jobs.update_progress(job.id, generation=2, best=0.5)
    requeued = jobs.requeue(job.id, "replica died")
    assert requeued.state is JobState.CREATED and requeued.attempts == 1 and requeued.progress == {}
    jobs.transition(job.id, "PREPARING")
    events = jobs.events(job.id)
    assert [e.event for e in events] == ["created", "transition", "transition", "interrupted", "replayed"]
    assert events[3].from_state is JobState.RUNNING and events[3].reason == "replica died"
    jobs.fail(job.id, "INTERNAL_ERROR", "x")
    with pytest.raises(AlloyError) as caught:
        jobs.requeue(job.id, "too late")
    assert caught.value.code is ErrorCode.CONFLICT


def test_list_filters_pages_and_active(jobs):
    created = [
        jobs.create("merge" if i % 2 else "evaluation", {"i": i}, owner="bob" if i < 3 else None) for i in range(5)
    ]
    jobs.transition(created[0].id, "PREPARING")
    jobs.fail(created[1].id, "INTERNAL_ERROR", "x")
    page = jobs.list(limit=2)
    assert page.total == 5 and len(page.items) == 2 and page.limit == 2
    everything = page.items + jobs.list(offset=2, limit=10).items
    assert len({j.id for j in everything}) == 5
    assert {j.id for j in jobs.list(kind="merge").items} == {created[1].id, created[3].id}
    assert jobs.list(state="FAILED").total == 1
    assert jobs.list(owner="bob").total == 3
    assert {j.id for j in jobs.active()} == {c.id for c in created} - {created[1].id}
    assert {j.id for j in jobs.active(kind="merge")} == {created[3].id}
    with pytest.raises(AlloyError):
        jobs.list(limit=0)
