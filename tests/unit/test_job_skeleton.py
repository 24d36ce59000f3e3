"""The job skeleton every engine runs its jobs through (alloy.jobs.skeleton), without Ray: claim, heartbeat,
endings with codes, cancel and requeue, lost ownership, slots, the orphan sweeper, drain and the shielded run.
The job store is the real one on a SQLite file."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from alloy.errors import AlloyError, ErrorCode
from alloy.jobs.records import JobKind, JobState
from alloy.jobs.skeleton import JobInterrupted, JobRun, JobRunner, run_shielded
from alloy.jobs.store import JobStore
from alloy.storage.db import Database


@pytest.fixture
def jobs(tmp_path) -> JobStore:
    db = Database(f"sqlite:///{tmp_path / 'jobs.db'}")
    db.upgrade()
    yield JobStore(db)
    db.close()


def _job(jobs: JobStore) -> str:
    return jobs.create(JobKind.EVALUATION, {"n": 1}).id


def test_a_body_result_completes_the_job_and_the_heartbeat_beats_while_it_runs(jobs):
    seen = {}

    def body(run: JobRun) -> dict:
        assert jobs.get(run.job_id).state is JobState.PREPARING  # claimed before the body runs
        run.transition(JobState.RUNNING)
        time.sleep(0.35)
        seen["heartbeat"] = jobs.get(run.job_id).progress.get("heartbeat_at")
        return {"answer": 42}

    job_id = _job(jobs)
    record = JobRunner(jobs, JobKind.EVALUATION, body, heartbeat_s=0.1).run(job_id)
    assert record.state is JobState.COMPLETED and record.result == {"answer": 42}
    assert seen["heartbeat"] is not None


@pytest.mark.parametrize(
    "error, code",
    [
        (AlloyError(ErrorCode.MODEL_NOT_FOUND, "no such model"), "MODEL_NOT_FOUND"),
        (RuntimeError("boom"), "INTERNAL_ERROR"),
    ],
)
def test_a_failing_body_fails_the_job_with_a_code_and_undoes_its_outputs(jobs, error, code):
    calls: list[str] = []

    def body(run: JobRun) -> dict:
        run.on_undo(lambda: calls.append("undo"))
        run.on_exit(lambda: calls.append("exit"))
        raise error

    record = JobRunner(jobs, JobKind.EVALUATION, body).run(_job(jobs))
    assert record.state is JobState.FAILED and record.error.code == code
    assert calls == ["undo", "exit"]


def test_a_completed_job_keeps_its_outputs(jobs):
    calls: list[str] = []

    def body(run: JobRun) -> dict:
        run.on_undo(lambda: calls.append("undo"))
        run.on_exit(lambda: calls.append("exit"))
        run.transition(JobState.RUNNING)
        return {}

    assert JobRunner(jobs, JobKind.EVALUATION, body).run(_job(jobs)).state is JobState.COMPLETED
    assert calls == ["exit"]


def test_a_cancelled_run_requeues_its_job_with_an_interrupted_event(jobs):
    def body(run: JobRun) -> dict:
        run.cancel.set()
        run.check_cancel()
        return {}

    record = JobRunner(jobs, JobKind.EVALUATION, body).run(_job(jobs))
    assert record.state is JobState.CREATED and record.attempts == 1
    assert jobs.events(record.id)[-1].event == "interrupted"


def test_only_one_of_two_dispatches_runs_the_job(jobs):
    runs: list[str] = []
    job_id = _job(jobs)
    jobs.transition(job_id, JobState.PREPARING)  # another replica claimed it

    record = JobRunner(jobs, JobKind.EVALUATION, lambda run: runs.append(run.job_id) or {}).run(job_id)
    assert runs == [] and record.state is JobState.PREPARING


def test_a_job_moved_by_someone_else_is_left_as_it_is(jobs):
    """A sweeper (or a forced stop) requeued the job while the body ran: the body's next write conflicts, and
    the runner neither fails nor completes the requeued job; its own outputs are undone."""
    undone: list[str] = []

    def body(run: JobRun) -> dict:
        run.on_undo(lambda: undone.append(run.job_id))
        jobs.requeue(run.job_id, "owner lost")
        run.transition(JobState.RUNNING)  # CREATED -> RUNNING is illegal: CONFLICT
        return {}

    record = JobRunner(jobs, JobKind.EVALUATION, body).run(_job(jobs))
    assert record.state is JobState.CREATED and record.error is None and undone == [record.id]


def test_slots_bound_concurrency_and_waiting_jobs_count_as_held(jobs):
    active, peak, lock = [0], [0], threading.Lock()
    release = threading.Event()

    def body(run: JobRun) -> dict:
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        release.wait(5)
        with lock:
            active[0] -= 1
        run.transition(JobState.RUNNING)
        return {}

    runner = JobRunner(jobs, JobKind.EVALUATION, body, slots=1)
    ids = [_job(jobs), _job(jobs)]
    threads = [threading.Thread(target=runner.run, args=(job_id,)) for job_id in ids]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 5
    while (len(runner.accepted) < 2 or not runner.running) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert runner.accepted == set(ids) and len(runner.running) == 1
    release.set()
    for thread in threads:
        thread.join(10)
    assert peak[0] == 1 and all(jobs.get(i).state is JobState.COMPLETED for i in ids)


def test_drain_requeues_a_job_whose_body_ignores_the_cancel(jobs):
    started, finish = threading.Event(), threading.Event()

    def stubborn(run: JobRun) -> dict:
        started.set()
        finish.wait(10)
        return {}

    runner = JobRunner(jobs, JobKind.EVALUATION, stubborn)
    job_id = _job(jobs)
    thread = threading.Thread(target=runner.run, args=(job_id,))
    thread.start()
    assert started.wait(5)
    assert runner.drain(grace_s=0.2) == [job_id]
    assert jobs.get(job_id).state is JobState.CREATED
    finish.set()
    thread.join(10)
    assert jobs.get(job_id).state is JobState.CREATED  # the late finish found the job moved: left as it is


def test_the_sweeper_dispatches_lost_jobs_of_its_kind_and_keeps_its_own(jobs):
    lost, other_kind = _job(jobs), jobs.create(JobKind.MERGE, {}).id
    for job_id in (lost, other_kind):
        jobs.transition(job_id, JobState.PREPARING)
    dispatched: list[str] = []
    runner = JobRunner(jobs, JobKind.EVALUATION, lambda run: {})
    runner.accepted.add("held-here")
    sweeper = runner.start_sweeper(stale_after_s=0, dispatch=dispatched.append, interval_s=60, first_after_s=60)
    try:
        assert sweeper.sweep() == [lost] and dispatched == [lost]
    finally:
        sweeper.stop()
    assert jobs.get(lost).state is JobState.CREATED and jobs.get(other_kind).state is JobState.PREPARING


def test_a_shielded_run_outlives_its_caller():
    finished = threading.Event()

    def work() -> str:
        time.sleep(0.3)
        finished.set()
        return "done"

    async def scenario() -> str:
        task = asyncio.ensure_future(run_shielded(work))
        await asyncio.sleep(0.05)
        task.cancel()  # the caller went away
        await asyncio.sleep(0.05)
        assert not task.done()  # still an ongoing request
        return await task

    assert asyncio.run(scenario()) == "done" and finished.is_set()


def test_check_cancel_raises_only_once_cancelled():
    run = JobRun(jobs=None, record=None, cancel=threading.Event())  # type: ignore[arg-type]
    run.check_cancel()
    run.cancel.set()
    with pytest.raises(JobInterrupted):
        run.check_cancel()
