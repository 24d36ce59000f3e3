"""Cold and warm start sequences with the real configuration loader, dependency checks, database (SQLite and
PostgreSQL) and registries; the Serve-provided steps (pools, endpoint health) are plain callables here."""

from __future__ import annotations

import pytest

from alloy.cluster.startup import (
    COLD_STEPS,
    StartContext,
    cold_start,
    connect_registries,
    dependency_validation,
    load_configuration,
    warm_start,
)
from alloy.cluster.state import ClusterState, ClusterStateStore
from alloy.errors import AlloyError, ErrorCode

POOLS = {"MergeEngine": 2, "EvaluationEngine": 1, "EvolutionEngine": 1}


@pytest.fixture
def configured(database, tmp_path, monkeypatch):
    """The configuration sources point at the test database and a local artifact folder."""
    config = tmp_path / "alloy.yaml"
    config.write_text(f"data_dir: {tmp_path / 'var'}\nartifacts:\n  uri: {tmp_path / 'artifacts'}\n")
    monkeypatch.setenv("ALLOY_CONFIG", str(config))
    monkeypatch.setenv("ALLOY_DATABASE__URL", database.url)
    return database


class FakeServeLayer:
    """What the Serve layer provides: pools and endpoint health checks, recording what it saw."""

    def __init__(self):
        self.seen_states: list[ClusterState] = []
        self.gate_errors: list[AlloyError] = []

    def initialise_pools(self, ctx: StartContext) -> str:
        ctx["cluster_state"].save_pool_snapshot(POOLS)
        return f"{sum(POOLS.values())} replicas"

    def restore_pools(self, ctx: StartContext) -> str:
        pools = ctx["cluster_state"].pool_snapshot()
        ctx["restored"] = pools
        return f"restored {pools}"

    def health_check(self, ctx: StartContext) -> str:
        state: ClusterStateStore = ctx["cluster_state"]
        self.seen_states.append(state.state())
        try:  # a request arriving now is refused with the readiness code
            state.require()
        except AlloyError as exc:
            self.gate_errors.append(exc)
        return "all endpoints healthy"


def cold(serve: FakeServeLayer, **overrides):
    steps = dict(
        load_configuration=load_configuration,
        validate_dependencies=dependency_validation(),
        connect_registries=connect_registries,
        initialise_pools=serve.initialise_pools,
        health_check=serve.health_check,
    )
    steps.update(overrides)
    return cold_start(**steps)


def test_cold_start_runs_the_specified_steps_in_order(configured):
    serve = FakeServeLayer()
    sequence = cold(serve)
    assert sequence.step_names == [*COLD_STEPS, "mark READY"]
    run = sequence.run()
    assert run.ok and [s.name for s in run.steps] == [*COLD_STEPS, "mark READY"]
    assert all(s.status == "ok" and s.duration_s >= 0 for s in run.steps)
    status = ClusterStateStore(configured).get()
    assert status.state is ClusterState.READY and status.pools == POOLS
    assert [s.name for s in status.last_start.steps] == [*COLD_STEPS, "mark READY"]  # persisted step log
    # Before READY, requests got 503 SERVICE_UNAVAILABLE naming the state.
    assert serve.seen_states == [ClusterState.STARTING]
    assert serve.gate_errors[0].code is ErrorCode.SERVICE_UNAVAILABLE
    assert serve.gate_errors[0].details["cluster_state"] == "STARTING"


def test_a_failed_dependency_stops_the_start_naming_it(configured, monkeypatch):
    monkeypatch.setenv("ALLOY_MESSAGE_QUEUE_URL", "nats://127.0.0.1:29599")
    with pytest.raises(AlloyError) as caught:
        cold(FakeServeLayer()).run()
    error = caught.value
    assert error.code is ErrorCode.SERVICE_UNAVAILABLE and error.details["step"] == "validate dependencies"
    assert "message queue at nats://127.0.0.1:29599" in error.message
    assert [s["status"] for s in error.details["steps"]] == ["ok", "failed"]
    assert ClusterStateStore(configured).state() is ClusterState.STOPPED  # never became READY


def test_a_failed_health_check_leaves_the_cluster_stopped(configured):
    def unhealthy(_ctx):
        raise RuntimeError("MergeEngine did not answer")

    with pytest.raises(AlloyError) as caught:
        cold(FakeServeLayer(), health_check=unhealthy).run()
    assert caught.value.details["step"] == "health-check endpoints"
    status = ClusterStateStore(configured).get()
    assert status.state is ClusterState.STOPPED
    assert not status.last_start.ok and "MergeEngine did not answer" in status.last_start.error


def test_an_old_schema_is_refused_at_the_registry_step(empty_database, tmp_path, monkeypatch):
    monkeypatch.setenv("ALLOY_CONFIG", str(tmp_path / "none.yaml"))
    monkeypatch.setenv("ALLOY_DATA_DIR", str(tmp_path / "var"))
    monkeypatch.setenv("ALLOY_DATABASE__URL", empty_database.url)
    with pytest.raises(AlloyError) as caught:
        cold(FakeServeLayer()).run()
    assert caught.value.code is ErrorCode.SCHEMA_MISMATCH and "alloy db upgrade" in caught.value.message
    assert caught.value.details["step"] == "connect registries"


def test_warm_start_skips_validation_and_restores_the_pool_snapshot(configured, monkeypatch):
    cold(FakeServeLayer()).run()
    state = ClusterStateStore(configured)
    state.transition("STOPPING")
    state.transition("STOPPED")
    # A dependency that would fail: the operator's flag says not to check it.
    monkeypatch.setenv("ALLOY_MESSAGE_QUEUE_URL", "nats://127.0.0.1:29599")
    serve = FakeServeLayer()
    ctx = StartContext(mode="warm")
    run = warm_start(
        load_configuration=load_configuration,
        connect_registries=connect_registries,
        restore_pools=serve.restore_pools,
        health_check=serve.health_check,
        skip_dependency_checks=True,
    ).run(ctx)
    assert [(s.name, s.status) for s in run.steps] == [
        ("load configuration", "ok"),
        ("validate dependencies", "skipped"),
        ("restore worker pools", "ok"),
        ("abbreviated health checks", "ok"),
        ("mark READY", "ok"),
    ]
    assert ctx["restored"] == POOLS and state.state() is ClusterState.READY


def test_warm_start_without_the_flag_validates(configured, monkeypatch):
    monkeypatch.setenv("ALLOY_MESSAGE_QUEUE_URL", "nats://127.0.0.1:29599")
    serve = FakeServeLayer()
    with pytest.raises(AlloyError) as caught:
        warm_start(
            load_configuration=load_configuration,
            connect_registries=connect_registries,
            validate_dependencies=dependency_validation(),
            restore_pools=serve.restore_pools,
            health_check=serve.health_check,
            skip_dependency_checks=False,
        ).run()
    assert caught.value.details["step"] == "validate dependencies"


def test_a_failed_replay_after_ready_keeps_the_cluster_ready(configured):
    def broken_replay(_ctx):
        raise RuntimeError("dispatcher down")

    run = cold(FakeServeLayer(), replay=broken_replay).run()
    assert run.ok and run.steps[-1].name == "replay interrupted jobs" and run.steps[-1].status == "failed"
    assert ClusterStateStore(configured).state() is ClusterState.READY
