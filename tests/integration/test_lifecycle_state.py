"""ClusterStateStore: the persisted lifecycle state, its legal moves, the 503 gate and the pool snapshot, on
SQLite and PostgreSQL."""

from __future__ import annotations

import threading

import pytest

from alloy.cluster.state import (
    CachedClusterState,
    ClusterState,
    ClusterStateStore,
    LifecycleRun,
    StepLogEntry,
    state_metric_values,
)
from alloy.errors import AlloyError, ErrorCode


@pytest.fixture
def store(database) -> ClusterStateStore:
    return ClusterStateStore(database)


def ready(store: ClusterStateStore) -> None:
    store.begin_start("cold")
    store.mark_ready(config_version=3)


def test_a_fresh_database_reads_as_stopped(store):
    status = store.get()
    assert status.state is ClusterState.STOPPED and status.pools == {} and status.previous_stop_was_clean


def test_full_lifecycle_persists_every_state(store, database):
    previous = store.begin_start("cold")
    assert previous.state is ClusterState.STOPPED
    assert store.state() is ClusterState.STARTING
    assert store.mark_ready(config_version=3).config_version == 3
    for target in (ClusterState.DRAINING, ClusterState.STOPPING, ClusterState.STOPPED):
        store.transition(target)
        # a second store on the same database (another process) sees the same state
        assert ClusterStateStore(database).state() is target


@pytest.mark.parametrize(
    "path, illegal",
    [
        ([], "READY"),
        ([], "DRAINING"),
        (["START"], "DRAINING"),
        (["START", "READY", "DRAINING"], "READY"),
        (["START", "READY", "STOPPING"], "DRAINING"),
        (["START", "READY"], "STOPPED"),
    ],
)
def test_illegal_moves_are_conflicts(store, path, illegal):
    for step in path:
        store.begin_start("cold") if step == "START" else store.transition(step)
    before = store.state()
    with pytest.raises(AlloyError) as caught:
        store.transition(illegal)
    assert caught.value.code is ErrorCode.CONFLICT
    assert caught.value.details == {"cluster_state": before.value, "requested": illegal}
    assert store.state() is before


def test_moving_to_the_current_state_is_a_no_op(store):
    ready(store)
    store.transition("DRAINING")
    assert store.transition("DRAINING").state is ClusterState.DRAINING


def test_a_start_after_a_crash_sees_the_unclean_state(store):
    ready(store)  # ... and then the whole cluster is killed: nothing ever moves it on
    previous = store.begin_start("cold")
    assert previous.state is ClusterState.READY and not previous.previous_stop_was_clean
    assert store.get().snapshot["previous_state"] == "READY"


def test_a_forced_stop_is_recorded_as_unclean(store):
    ready(store)
    store.transition("STOPPING")
    store.transition("STOPPED")
    store.record_run("stop", LifecycleRun(mode="forced", ok=False, error="operator"))
    assert not store.get().previous_stop_was_clean


def test_only_one_of_two_racing_stops_wins(store):
    ready(store)
    results: list[str] = []
    barrier = threading.Barrier(2)

    def stop() -> None:
        barrier.wait()
        try:
            store.transition("DRAINING", expected="READY")
            results.append("won")
        except AlloyError as exc:
            results.append(exc.code.value)

    threads = [threading.Thread(target=stop) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == ["CONFLICT", "won"]


def test_pool_snapshot_round_trip_keeps_other_keys(store):
    store.update_snapshot(draining_nodes=["n1"])  # a key another module owns
    store.save_pool_snapshot({"MergeEngine": 2, "EvaluationEngine": 1})
    status = store.get()
    assert status.pools == {"MergeEngine": 2, "EvaluationEngine": 1}
    assert status.snapshot["draining_nodes"] == ["n1"]
    with pytest.raises(AlloyError) as caught:
        store.save_pool_snapshot({"MergeEngine": -1})
    assert caught.value.code is ErrorCode.VALIDATION_FAILED


def test_step_log_round_trip(store):
    run = LifecycleRun(
        mode="cold", ok=True, total_s=1.5, steps=[StepLogEntry(name="load configuration", status="ok", duration_s=0.01)]
    )
    store.record_run("start", run)
    assert store.get().last_start.steps[0].name == "load configuration"


@pytest.mark.parametrize(
    "state, submission, refused",
    [
        ("STOPPED", False, True),
        ("STARTING", False, True),
        ("READY", False, False),
        ("READY", True, False),
        ("DRAINING", False, False),
        ("DRAINING", True, True),
        ("STOPPING", True, True),
    ],
)
def test_the_503_gate(store, state, submission, refused):
    moves = {
        "STOPPED": [],
        "STARTING": ["START"],
        "READY": ["START", "READY"],
        "DRAINING": ["START", "READY", "DRAINING"],
        "STOPPING": ["START", "READY", "STOPPING"],
    }[state]
    for move in moves:
        store.begin_start("cold") if move == "START" else store.transition(move)
    if not refused:
        assert store.require(submission=submission).state.value == state
        return
    with pytest.raises(AlloyError) as caught:
        store.require(submission=submission)
    assert caught.value.code is ErrorCode.SERVICE_UNAVAILABLE and caught.value.http_status == 503
    assert caught.value.details["cluster_state"] == state
    assert caught.value.details["retryable"] is (state == "STARTING")


def test_cached_state_rereads_after_its_ttl(store):
    cached = CachedClusterState(store, ttl_s=0.2)
    assert cached.get() is ClusterState.STOPPED
    ready(store)
    assert cached.get() is ClusterState.STOPPED  # within the TTL: no query
    import time

    time.sleep(0.25)
    assert cached.require(submission=True) is ClusterState.READY


def test_metric_values_are_one_hot():
    values = state_metric_values("READY")
    assert values["READY"] == 1 and sum(values.values()) == 1 and set(values) == {s.value for s in ClusterState}
