"""The output claim and the submission gate, in the database itself, on SQLite and PostgreSQL: of concurrent
creations for one output id exactly one commits; FAILED frees the id, COMPLETED hands it to the registry; a job is
never created once the cluster left READY, even racing the move; migration 0004 adds the claim to a database
written before it; an INTERNAL_ERROR's own text never reaches the job record."""

from __future__ import annotations

import json
import logging
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from sqlalchemy import text

from alloy.cluster.state import ClusterState, ClusterStateStore
from alloy.errors import AlloyError, ErrorCode
from alloy.jobs.merge_admission import create_merge_job
from alloy.jobs.merge_request import MergeRequest
from alloy.jobs.records import JobKind, JobState
from alloy.jobs.store import JobStore
from alloy.storage.db import Database
from alloy.storage.db.models import ModelRow
from alloy.storage.db.types import utcnow

CONCURRENT = 6


def request(output: str, models: tuple[str, str] = ("a", "b")) -> MergeRequest:
    return MergeRequest(models=list(models), strategy="slerp", output_model_id=output)


def refused(action) -> AlloyError:
    with pytest.raises(AlloyError) as caught:
        action()
    return caught.value


@pytest.fixture
def jobs(database) -> JobStore:
    return JobStore(database)


def test_one_active_claim_per_output_and_failed_frees_it(jobs):
    first = create_merge_job(jobs, request("out"))
    assert jobs.claimant("out") == first.id
    error = refused(lambda: create_merge_job(jobs, request("out")))
    assert error.code is ErrorCode.ALREADY_EXISTS and error.details["model_id"] == "out"
    jobs.requeue(first.id, "replica went away")  # back to CREATED: still the claimant
    assert refused(lambda: create_merge_job(jobs, request("out"))).code is ErrorCode.ALREADY_EXISTS
    jobs.fail(first.id, ErrorCode.MODEL_NOT_FOUND, "an input vanished")
    assert jobs.claimant("out") is None
    assert create_merge_job(jobs, request("out")).state is JobState.CREATED


def test_a_completed_claim_is_held_by_the_registry(jobs, database):
    job = create_merge_job(jobs, request("done"))
    jobs.transition(job.id, JobState.PREPARING)
    jobs.transition(job.id, JobState.RUNNING)
    _register(database, "done")  # the merge registers its output as the last step before COMPLETED
    jobs.complete(job.id, {"model_id": "done"})
    error = refused(lambda: create_merge_job(jobs, request("done")))
    assert error.code is ErrorCode.ALREADY_EXISTS
    nested = refused(lambda: create_merge_job(jobs, request("done/inner")))
    assert nested.code is ErrorCode.VALIDATION_FAILED and nested.details["clashes_with"] == "done"


def test_concurrent_creations_for_one_output_commit_exactly_one(database):
    """Six threads, each with its own connection, create the same output at once, ten times over."""
    for round_ in range(10):
        output = f"race-{round_}"
        start = threading.Barrier(CONCURRENT)
        stores = [JobStore(Database(database.url)) for _ in range(CONCURRENT)]

        def create(store: JobStore, output: str = output, start: threading.Barrier = start) -> str:
            start.wait()
            try:
                return create_merge_job(store, request(output)).id
            except AlloyError as exc:
                return exc.code.value

        with ThreadPoolExecutor(CONCURRENT) as pool:
            outcomes = list(pool.map(create, stores))
        for store in stores:
            store.db.close()
        assert sorted(o for o in outcomes if o == "ALREADY_EXISTS") == ["ALREADY_EXISTS"] * (CONCURRENT - 1), outcomes
        assert JobStore(database).claimant(output) in outcomes


def test_jobs_are_refused_unless_the_cluster_is_ready(jobs, database):
    state = ClusterStateStore(database)
    error = refused(lambda: create_merge_job(jobs, request("early"), guards=[state.submission_guard]))
    assert error.code is ErrorCode.SERVICE_UNAVAILABLE and error.details["cluster_state"] == "STOPPED"
    state.begin_start("cold")
    state.mark_ready()
    job = create_merge_job(jobs, request("ready"), guards=[state.submission_guard])
    assert state.state() is ClusterState.READY and state.get().config_version == 1  # the guard changed nothing
    state.transition(ClusterState.DRAINING)
    error = refused(lambda: jobs.create(JobKind.EVALUATION, {}, guards=[state.submission_guard]))
    assert error.http_status == 503 and error.details == {"cluster_state": "DRAINING", "retryable": False}
    assert [j.id for j in jobs.active()] == [job.id]  # nothing written by the refused ones


def test_a_creation_racing_the_move_to_draining_is_ordered_before_it_or_refused(database):
    """Creations from several connections while another moves the cluster to DRAINING: each creation either
    committed before the move (the graceful stop then finds it active) or was refused."""
    state = ClusterStateStore(database)
    state.begin_start("cold")
    state.mark_ready()
    stop = threading.Event()
    outcomes: list[tuple[str, str]] = []

    def create_until_refused() -> None:
        local = Database(database.url)
        store, gate = JobStore(local), ClusterStateStore(local)
        try:
            while not stop.is_set():
                try:
                    job = store.create(JobKind.EVALUATION, {}, guards=[gate.submission_guard])
                    outcomes.append(("created", job.id))
                except AlloyError as exc:
                    outcomes.append((exc.code.value, ""))
                    return
        finally:
            local.close()

    threads = [threading.Thread(target=create_until_refused) for _ in range(3)]
    for thread in threads:
        thread.start()
    threading.Event().wait(0.3)
    state.transition(ClusterState.DRAINING)
    active_at_drain = {job.id for job in JobStore(database).active()}
    stop.set()
    for thread in threads:
        thread.join(30)
    created = {job_id for kind, job_id in outcomes if kind == "created"}
    assert created and created <= active_at_drain  # nothing committed after the move
    assert {kind for kind, _ in outcomes} <= {"created", "SERVICE_UNAVAILABLE"}


def test_an_internal_error_keeps_its_text_in_the_log_only(jobs, caplog):
    caplog.set_level(logging.ERROR, logger="alloy.jobs")
    job = jobs.create(JobKind.MERGE, {})
    planted = "merge failed: IntegrityError: (sqlite3.IntegrityError) UNIQUE constraint failed: INSERT INTO /var/lib/x"
    failed = jobs.fail(job.id, ErrorCode.INTERNAL_ERROR, planted)
    assert failed.error.code == "INTERNAL_ERROR"
    assert failed.error.message == f"internal error; the server log has the details under reference {job.id}"
    assert all(planted not in str(event.details) for event in jobs.events(job.id))
    assert any(job.id in r.getMessage() and planted in r.getMessage() for r in caplog.records)
    other = jobs.create(JobKind.MERGE, {})
    assert jobs.fail(other.id, ErrorCode.MODEL_NOT_FOUND, "model 'x' is not registered").error.message == (
        "model 'x' is not registered"  # spec and client errors keep their own message
    )


def test_migration_0004_claims_the_oldest_active_merge_of_each_output(empty_database):
    empty_database.upgrade("0002")
    rows = [
        ("old", "merge", "RUNNING", "dup", "2026-01-01 00:00:00"),
        ("new", "merge", "CREATED", "dup", "2026-01-02 00:00:00"),
        ("done", "merge", "COMPLETED", "solo", "2026-01-01 00:00:00"),
        ("eval", "evaluation", "RUNNING", None, "2026-01-01 00:00:00"),
    ]
    with empty_database.engine.begin() as connection:
        for job_id, kind, state, output, at in rows:
            body = json.dumps({"output_model_id": output} if output else {})
            connection.execute(
                text(
                    "INSERT INTO jobs (id, kind, state, progress, request, attempts, created_at, updated_at) "
                    "VALUES (:id, :kind, :state, '{}', :request, 0, :at, :at)"
                ),
                {"id": job_id, "kind": kind, "state": state, "request": body, "at": at},
            )
    empty_database.upgrade()
    store = JobStore(empty_database)
    assert store.claimant("dup") == "old" and store.claimant("solo") is None
    assert refused(lambda: create_merge_job(store, request("dup"))).code is ErrorCode.ALREADY_EXISTS
    empty_database.downgrade("0002")
    empty_database.upgrade()


def _register(database: Database, model_id: str) -> None:
    with database.session() as session:
        session.add(
            ModelRow(
                id=model_id,
                parameter_count=1,
                fingerprint="f",
                tensor_count=1,
                size_bytes=1,
                manifest={},
                created_at=utcnow(),
            )
        )
