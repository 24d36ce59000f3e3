"""Graceful and forced shutdown over the real JobStore and cluster state (SQLite and PostgreSQL): the order of
the steps, the wait for active merges and evaluations, the timeout that escalates to forced, best effort."""

from __future__ import annotations

import threading
import time

import pytest

from alloy.cluster.shutdown import Shutdown, ShutdownActions
from alloy.cluster.state import ClusterState, ClusterStateStore
from alloy.errors import AlloyError, ErrorCode
from alloy.jobs.store import JobStore

GRACEFUL_STEPS = [
    "reject submissions",
    "wait for active merges and evaluations",
    "flush tracker",
    "close registries",
    "terminate worker pools",
    "mark STOPPED",
]
FORCED_STEPS = [
    "cancel active tasks",
    "flush tracker (best effort)",
    "close registries (best effort)",
    "terminate processes",
    "mark STOPPED",
]


@pytest.fixture
def state(database) -> ClusterStateStore:
    store = ClusterStateStore(database)
    store.begin_start("cold")
    store.mark_ready()
    return store


@pytest.fixture
def jobs(database) -> JobStore:
    return JobStore(database)


class RecordingActions(ShutdownActions):
    """Actions that record their order; ``cancel_active`` requeues what is running, as the engines do."""

    def __init__(self, jobs: JobStore, fail: set[str] = frozenset()):
        self.calls: list[str] = []

        def action(name: str, effect=None):
            def run() -> str:
                self.calls.append(name)
                if name in fail:
                    raise RuntimeError(f"{name} broke")
                return effect() if effect else name

            return run

        def cancel() -> str:
            active = jobs.active()
            for job in active:
                jobs.requeue(job.id, "interrupted: forced shutdown")
            return f"cancelled {len(active)}"

        super().__init__(
            cancel_active=action("cancel", cancel),
            flush_tracker=action("flush"),
            close_registries=action("close"),
            terminate_pools=action("terminate"),
        )


def running_job(jobs: JobStore, kind: str = "merge") -> str:
    job = jobs.create(kind, {})
    jobs.transition(job.id, "PREPARING")
    jobs.transition(job.id, "RUNNING")
    return job.id


def test_graceful_waits_for_an_active_merge_and_refuses_submissions_meanwhile(state, jobs):
    job_id = running_job(jobs)
    seen: dict[str, object] = {}

    def finish_later() -> None:
        time.sleep(1.0)
        seen["state_while_waiting"] = state.state()
        try:
            state.require(submission=True)
        except AlloyError as exc:
            seen["refusal"] = exc
        seen["reads_allowed"] = state.require().state  # reads and progress polling still work
        jobs.complete(job_id, {"model_id": "m"})

    worker = threading.Thread(target=finish_later)
    worker.start()
    actions = RecordingActions(jobs)
    report = Shutdown(state, jobs, actions, timeout_s=30, poll_s=0.1).graceful()
    worker.join()

    assert report.run.ok and report.run.mode == "graceful" and not report.escalated
    assert [s.name for s in report.run.steps] == GRACEFUL_STEPS
    assert report.waited_for == [job_id] and jobs.get(job_id).state.value == "COMPLETED"
    assert report.run.steps[1].duration_s >= 0.9  # it really waited
    assert actions.calls == ["flush", "close", "terminate"]
    assert seen["state_while_waiting"] is ClusterState.DRAINING
    assert seen["refusal"].code is ErrorCode.SERVICE_UNAVAILABLE
    assert seen["reads_allowed"] is ClusterState.DRAINING
    status = state.get()
    assert status.state is ClusterState.STOPPED and status.previous_stop_was_clean
    assert [s.name for s in status.last_stop.steps] == GRACEFUL_STEPS


def test_graceful_past_its_timeout_escalates_to_forced(state, jobs):
    job_id = running_job(jobs, "evaluation")
    actions = RecordingActions(jobs)
    started = time.monotonic()
    report = Shutdown(state, jobs, actions, timeout_s=1, poll_s=0.1).graceful()
    assert time.monotonic() - started < 10
    assert report.escalated and report.run.mode == "graceful->forced" and not report.run.ok
    assert report.unfinished == [job_id] and "exceeded its 1s timeout" in report.run.error
    assert [s.name for s in report.run.steps] == GRACEFUL_STEPS[:2] + FORCED_STEPS
    assert actions.calls == ["cancel", "flush", "close", "terminate"]
    assert jobs.events(job_id)[-1].event == "interrupted"
    status = state.get()
    assert status.state is ClusterState.STOPPED and not status.previous_stop_was_clean


def test_a_force_request_during_the_graceful_wait_escalates_at_once(state, jobs):
    """`alloy stop --force` (or a second Ctrl-C) while a graceful stop waits: no need to sit out the timeout."""
    job_id = running_job(jobs)
    forced = threading.Event()
    threading.Timer(0.5, forced.set).start()
    actions = RecordingActions(jobs)
    started = time.monotonic()
    report = Shutdown(state, jobs, actions, timeout_s=300, poll_s=0.1, force_requested=forced.is_set).graceful()
    assert time.monotonic() - started < 10
    assert report.escalated and report.run.mode == "graceful->forced"
    assert report.run.error == "forced by the operator during the graceful wait"
    assert actions.calls == ["cancel", "flush", "close", "terminate"]
    assert jobs.get(job_id).state.value == "CREATED" and jobs.events(job_id)[-1].event == "interrupted"


def test_evolutions_are_not_waited_for(state, jobs):
    running_job(jobs, "evolution")
    report = Shutdown(state, jobs, RecordingActions(jobs), timeout_s=30).graceful()
    assert report.run.ok and report.waited_for == [] and report.run.steps[1].duration_s < 5


def test_forced_is_best_effort(state, jobs):
    job_id = running_job(jobs)
    actions = RecordingActions(jobs, fail={"flush", "close"})
    report = Shutdown(state, jobs, actions).forced("operator asked: --force")
    assert actions.calls == ["cancel", "flush", "close", "terminate"]
    assert [(s.name, s.status) for s in report.run.steps] == [
        ("cancel active tasks", "ok"),
        ("flush tracker (best effort)", "failed"),
        ("close registries (best effort)", "failed"),
        ("terminate processes", "ok"),
        ("mark STOPPED", "ok"),
    ]
    assert report.run.mode == "forced" and report.run.error == "operator asked: --force"
    assert state.state() is ClusterState.STOPPED and jobs.get(job_id).state.value == "CREATED"


def test_a_failing_graceful_step_does_not_stop_the_others(state, jobs):
    actions = RecordingActions(jobs, fail={"close"})
    report = Shutdown(state, jobs, actions, timeout_s=5).graceful()
    assert actions.calls == ["flush", "close", "terminate"]
    assert not report.run.ok and "close registries" in report.run.error
    assert state.state() is ClusterState.STOPPED


def test_stopping_a_stopped_cluster_is_harmless(state, jobs):
    Shutdown(state, jobs, RecordingActions(jobs), timeout_s=5).graceful()
    again = Shutdown(state, jobs, RecordingActions(jobs), timeout_s=5).graceful()
    assert again.run.ok and state.state() is ClusterState.STOPPED
