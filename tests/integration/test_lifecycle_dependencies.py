"""Dependency validation against the real things: SQLite and PostgreSQL, a local folder and the moto S3 server,
RabbitMQ (AMQP 0-9-1), NATS and Redis running on this machine, and closed ports that must fail naming what
failed."""

from __future__ import annotations

import pytest

from alloy.cluster.dependencies import (
    check_database,
    check_gpu_nodes,
    check_message_queue,
    check_object_store,
    masked,
    validate_dependencies,
)
from alloy.config import Settings
from alloy.control.ports import pick_port_block
from alloy.errors import AlloyError, ErrorCode
from tests.services import require_nats, require_rabbitmq, require_redis

AMQP_URL = "amqp://guest:guest@127.0.0.1:5672/"
NATS_URL = "nats://127.0.0.1:4222"
REDIS_URL = "redis://127.0.0.1:6379/0"


REQUIRE_BROKER = {"amqp": require_rabbitmq, "nats": require_nats, "redis": require_redis}


@pytest.fixture(scope="module")
def closed_port() -> int:
    """A port nothing listens on (free when picked, inside the project's port range)."""
    return pick_port_block(1)[0]


def test_database_select_1(database):
    check = check_database(database)
    assert check.ok and check.name == "database" and "SELECT 1 ok" in check.detail


def test_database_unreachable_is_named(closed_port):
    from alloy.storage.db import Database

    db = Database(f"postgresql://alloy:s3cret@127.0.0.1:{closed_port}/alloy")
    check = check_database(db)
    db.close()
    assert not check.ok and "s3cret" not in check.target and str(closed_port) in check.target


def test_object_store_probe_leaves_nothing(artifact_store):
    check = check_object_store(artifact_store)
    assert check.ok, check.detail
    assert artifact_store.list() == []


def test_object_store_unreachable_s3_fails_fast(tmp_path, closed_port):
    settings = Settings(
        data_dir=tmp_path,
        artifacts={
            "uri": "s3://nowhere/x",
            "s3": {"endpoint_url": f"http://127.0.0.1:{closed_port}", "access_key_id": "k", "secret_access_key": "s"},
        },
    )
    report = validate_dependencies(settings, timeout_s=2)
    store = next(c for c in report.checks if c.name == "object store")
    assert not store.ok and store.duration_s < 30
    assert "connect" in store.detail.lower(), store.detail
    assert report.checks[0].ok  # the SQLite database in tmp_path is fine


@pytest.mark.parametrize(
    "url, expected",
    [
        (AMQP_URL, "AMQP 0-9-1 login as 'guest'"),
        (NATS_URL, "CONNECT/PING ok"),
        (REDIS_URL, "PING ok"),
    ],
)
def test_message_queue_handshakes(url, expected):
    REQUIRE_BROKER[url.split(":", 1)[0]]()
    check = check_message_queue(url, timeout_s=5)
    assert check.ok, check.detail
    assert expected in check.detail


@pytest.mark.parametrize(
    "url, reason",
    [
        ("amqp://guest:wrong@127.0.0.1:5672/", "ACCESS_REFUSED"),
        ("amqp://guest:guest@127.0.0.1:5672/no-such-vhost", "vhost"),
        ("redis://:wrong@127.0.0.1:6379/0", "authentication refused"),
        ("nats://127.0.0.1:6379", "timed out"),  # a Redis port does not speak NATS
        ("kafka://127.0.0.1:9092", "unsupported scheme"),
    ],
)
def test_message_queue_refusals_say_why(url, reason):
    if url.startswith(tuple(REQUIRE_BROKER)):
        REQUIRE_BROKER[url.split(":", 1)[0]]()
    check = check_message_queue(url, timeout_s=2)
    assert not check.ok and reason in check.detail
    assert "wrong" not in check.target


@pytest.mark.parametrize("scheme", ["amqp", "nats", "redis"])
def test_message_queue_on_a_closed_port(scheme, closed_port):
    check = check_message_queue(f"{scheme}://127.0.0.1:{closed_port}", timeout_s=2)
    assert not check.ok and check.name == "message queue"
    assert str(closed_port) in check.detail or "onnect" in check.detail


def test_gpu_nodes_check_uses_the_given_count():
    assert check_gpu_nodes(lambda: 2).ok
    failed = check_gpu_nodes(lambda: 0)
    assert not failed.ok and "needs at least 1 GPU, the cluster has 0" in failed.detail


def test_validate_names_every_failure_in_one_error(tmp_path, closed_port):
    settings = Settings(
        data_dir=tmp_path, profile="gpu", message_queue_url=f"amqp://guest:topsecret@127.0.0.1:{closed_port}/"
    )
    report = validate_dependencies(settings, gpu_count=lambda: 0, timeout_s=2)
    assert [c.name for c in report.checks] == ["database", "object store", "message queue", "GPU nodes"]
    assert [c.name for c in report.failures] == ["message queue", "GPU nodes"]
    with pytest.raises(AlloyError) as caught:
        report.raise_for_failures()
    error = caught.value
    assert error.code is ErrorCode.SERVICE_UNAVAILABLE
    assert "message queue at amqp://guest:***@127.0.0.1" in error.message and "GPU nodes" in error.message
    assert "topsecret" not in str(error.to_dict())
    assert error.details["failed"] == ["message queue", "GPU nodes"]


def test_gpu_only_failure_is_gpu_unavailable(tmp_path):
    report = validate_dependencies(Settings(data_dir=tmp_path, profile="gpu"), gpu_count=lambda: 0)
    with pytest.raises(AlloyError) as caught:
        report.raise_for_failures()
    assert caught.value.code is ErrorCode.GPU_UNAVAILABLE


def test_cpu_profile_without_queue_checks_database_and_store_only(tmp_path):
    report = validate_dependencies(Settings(data_dir=tmp_path))
    assert [c.name for c in report.checks] == ["database", "object store"] and report.ok


def test_all_real_dependencies_pass(tmp_path, s3_server, make_database_url):
    require_rabbitmq()
    settings = Settings(
        data_dir=tmp_path,
        database={"url": make_database_url("postgresql")},
        message_queue_url=AMQP_URL,
        artifacts={
            "uri": s3_server.new_uri(),
            "s3": {
                "endpoint_url": s3_server.endpoint_url,
                "access_key_id": "alloy-test-key",
                "secret_access_key": "alloy-test-secret",
            },
        },
    )
    report = validate_dependencies(settings)
    assert report.ok, report.failures
    assert report.raise_for_failures() is report


def test_masked_hides_passwords_and_tokens():
    assert masked("amqp://u:p@h:1/v") == "amqp://u:***@h:1/v"
    assert masked("nats://tok@h:4222") == "nats://***@h:4222"
    assert masked("redis://h:6379") == "redis://h:6379"
