"""The job lease (alloy.jobs.liveness) without Ray, on a real SQLite job store: a run whose lease lapsed is
fenced (it can never end the next attempt), one interruption counts one attempt whoever sees it first (sweeper,
the run itself, a forced stop, the start-up recovery), a lost run's leftovers are removed when its job is
requeued, and a sweeper finds a dead owner within lease + sweep period."""

from __future__ import annotations

import threading
import time

import pytest

from alloy.jobs.liveness import OrphanSweeper, requeue_lost, sweep_orphans
from alloy.jobs.records import JobKind, JobRecord, JobState
from alloy.jobs.skeleton import JobRun, JobRunner
from alloy.jobs.store import JobStore
from alloy.storage.db import Database


@pytest.fixture
def db(tmp_path):
    database = Database(f"sqlite:///{tmp_path / 'jobs.db'}")
    database.upgrade()
    yield database
    database.close()


@pytest.fixture
def jobs(db) -> JobStore:
    return JobStore(db)


def _wait(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_a_run_whose_lease_lapsed_is_fenced_and_never_ends_the_next_attempt(jobs):
    """The first run stalls past its lease; a sweeper requeues the job and a second run claims it. The first
    run's heartbeat finds the job at another attempt and cancels it; whatever it then does (complete, fail) is
    refused, so the second run alone ends the job."""
    stalled, release = threading.Event(), threading.Event()
    outcomes: dict[str, str] = {}

    first_runs: list[JobRun] = []

    def first_body(run: JobRun) -> dict:
        first_runs.append(run)
        run.transition(JobState.RUNNING)
        stalled.set()
        release.wait(10)
        return {"by": "first"}  # a stale result: must not complete attempt 1

    job_id = jobs.create(JobKind.MERGE, {}).id
    first = JobRunner(jobs, JobKind.MERGE, first_body, heartbeat_s=0.05)
    thread = threading.Thread(target=lambda: outcomes.update(first=first.run(job_id).state.value))
    thread.start()
    stalled.wait(10)
    assert sweep_orphans(jobs, kind=JobKind.MERGE, stale_after_s=0) == [job_id]  # its lease "lapsed"

    second_started = threading.Event()

    def second_body(run: JobRun) -> dict:
        second_started.set()
        run.transition(JobState.RUNNING)
        _wait(lambda: first.running.get(job_id) is not None and first.running[job_id].is_set())  # fenced
        release.set()
        thread.join(10)
        return {"by": "second"}

    record = JobRunner(jobs, JobKind.MERGE, second_body, heartbeat_s=0.05).run(job_id)
    assert second_started.is_set()
    assert record.state is JobState.COMPLETED and record.result == {"by": "second"}, record
    assert record.attempts == 1
    assert outcomes["first"] == "RUNNING"  # it gave the job up as it found it: the second run's
    assert first_runs[0].lost.is_set()  # what a body without cancel points (a Tune search) watches
    assert [e.event for e in jobs.events(job_id)].count("interrupted") == 1


def test_one_interruption_is_one_attempt_when_the_sweeper_and_the_run_both_see_it(jobs):
    """A sweeper requeued the job; the old run, cancelled afterwards (its replica shutting down), must not
    requeue it a second time."""
    started, release = threading.Event(), threading.Event()

    def body(run: JobRun) -> dict:
        run.transition(JobState.RUNNING)
        started.set()
        release.wait(10)
        run.check_cancel()
        return {}

    job_id = jobs.create(JobKind.EVALUATION, {}).id
    runner = JobRunner(jobs, JobKind.EVALUATION, body, heartbeat_s=30)
    cancel = threading.Event()
    thread = threading.Thread(target=lambda: runner.run(job_id, cancel))
    thread.start()
    started.wait(10)
    assert sweep_orphans(jobs, kind=JobKind.EVALUATION, stale_after_s=0) == [job_id]
    cancel.set()
    release.set()
    thread.join(10)
    record = jobs.get(job_id)
    assert record.state is JobState.CREATED and record.attempts == 1
    assert [e.event for e in jobs.events(job_id)].count("interrupted") == 1


def test_a_forced_stop_then_the_start_up_recovery_count_one_attempt(db, jobs, tmp_path):
    """`alloy stop --force` requeues the running job; the next start's consistency check finds it CREATED: it is
    replayed as it is, not requeued again (it used to read ``attempts: 2``)."""
    from alloy.cluster.recovery import Recovery
    from alloy.control.serve_ops import requeue_active
    from alloy.storage.artifacts import ArtifactStore

    running = jobs.create(JobKind.MERGE, {"output_model_id": "x"}).id
    jobs.transition(running, JobState.PREPARING)
    jobs.transition(running, JobState.RUNNING)
    queued = jobs.create(JobKind.MERGE, {"output_model_id": "y"}).id

    assert requeue_active(jobs, "interrupted: forced shutdown") == "1 active jobs requeued"
    recovery = Recovery(db, ArtifactStore(tmp_path / "artifacts"))
    repaired = recovery.repair(recovery.check())

    assert repaired.requeued == []
    assert jobs.get(running).attempts == 1 and jobs.get(queued).attempts == 0
    assert [e.event for e in jobs.events(running)].count("interrupted") == 1


def test_requeue_lost_cleans_the_lost_runs_leftovers_once(jobs, tmp_path):
    scratch = tmp_path / "scratch"
    cleaned: list[JobRecord] = []

    def clean(record: JobRecord) -> None:
        cleaned.append(record)
        scratch.rmdir()

    job = jobs.create(JobKind.MERGE, {}).id
    jobs.transition(job, JobState.PREPARING)
    seen = jobs.get(job)
    scratch.mkdir()
    assert requeue_lost(jobs, seen, "owner lost", clean) is not None
    assert requeue_lost(jobs, seen, "owner lost", clean) is None  # a second sweeper that saw the same run
    assert [r.attempts for r in cleaned] == [1] and not scratch.exists()


def test_the_sweeper_finds_a_dead_owner_within_lease_plus_sweep_period(jobs):
    """An owner that stops beating (its process died): requeued and dispatched within lease + sweep period."""
    lease_s, sweep_s = 1.0, 0.2
    job_id = jobs.create(JobKind.EVOLUTION, {}).id
    jobs.transition(job_id, JobState.PREPARING)
    jobs.update_progress(job_id, heartbeat_at="last beat")
    last_beat = time.monotonic()
    dispatched: list[float] = []
    sweeper = OrphanSweeper(
        jobs,
        JobKind.EVOLUTION,
        stale_after_s=lease_s,
        running_here=set,
        dispatch=lambda _job: dispatched.append(time.monotonic()),
        interval_s=sweep_s,
        first_after_s=0.0,
    ).start()
    try:
        _wait(lambda: bool(dispatched), timeout_s=10)
    finally:
        sweeper.stop()
    assert lease_s - 0.1 <= dispatched[0] - last_beat <= lease_s + sweep_s + 1.0  # + 1 s for a loaded machine
    assert jobs.get(job_id).attempts == 1
