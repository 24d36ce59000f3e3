"""Rate limits hold across ingress replicas: two uvicorn processes of the same app share limits through the real
Redis on 127.0.0.1:6379, concurrent clients hammer both, and exactly the limit is admitted.

Only keys under this test's own prefix, in a database number nothing else here uses, are touched (never FLUSHALL /
FLUSHDB: Redis is shared)."""

from __future__ import annotations

import json
import uuid
from concurrent.futures import ThreadPoolExecutor
from threading import Barrier

import httpx
import pytest
import redis

from alloy.storage.db import Database
from alloy.storage.keys import ApiKeyStore
from tests.security_helpers import serve_in_processes
from tests.services import service_missing

REDIS_URL = "redis://127.0.0.1:6379/11"
MERGE_BODY = {"models": ["base", "tuned"], "strategy": "ties", "output_model": "merged"}


@pytest.fixture(scope="module")
def redis_prefix():
    client = redis.Redis.from_url(REDIS_URL)
    try:
        client.ping()
    except redis.ConnectionError:
        service_missing("Redis", f"{REDIS_URL} is unreachable")
    prefix = f"alloy-test-{uuid.uuid4().hex[:12]}"
    yield prefix
    keys = list(client.scan_iter(match=f"{prefix}*"))
    if keys:
        client.delete(*keys)
    client.close()


@pytest.fixture(scope="module")
def replicas(tmp_path_factory, redis_prefix):
    db_url = f"sqlite:///{tmp_path_factory.mktemp('replicas') / 'alloy.db'}"
    Database(db_url).upgrade()
    env = {
        "ALLOY_TEST_DB_URL": db_url,
        "ALLOY_TEST_RATE_SETTINGS": json.dumps({"storage_uri": REDIS_URL, "key_prefix": redis_prefix}),
    }
    with serve_in_processes(2, env) as urls:
        yield urls, ApiKeyStore(Database(db_url))


def hammer(urls: list[str], method: str, path: str, key: str, per_replica: int, **kwargs) -> list[int]:
    """``per_replica`` threads per replica, released together, one request each; the statuses."""
    barrier = Barrier(per_replica * len(urls))
    clients = [httpx.Client(base_url=url, timeout=30, headers={"Authorization": f"Bearer {key}"}) for url in urls]

    def one(index: int) -> int:
        client = clients[index % len(clients)]
        barrier.wait()
        return client.request(method, path, **kwargs).status_code

    try:
        with ThreadPoolExecutor(max_workers=per_replica * len(urls)) as pool:
            return list(pool.map(one, range(per_replica * len(urls))))
    finally:
        for client in clients:
            client.close()


def test_job_limit_holds_exactly_across_two_replicas(replicas, redis_prefix):
    urls, store = replicas
    key = store.create("tester", ["write"])[1]  # default jobs limit: 10/minute
    statuses = hammer(urls, "POST", "/merge/execute", key, per_replica=15, json=MERGE_BODY)
    assert statuses.count(202) == 10 and statuses.count(429) == 20, statuses
    # both replicas now refuse, and report the shared state
    for url in urls:
        response = httpx.post(url + "/merge/execute", json=MERGE_BODY, headers={"X-API-Key": key})
        assert response.status_code == 429 and response.headers["x-ratelimit-remaining"] == "0"
        assert int(response.headers["retry-after"]) >= 1
    assert any(
        k.decode().startswith(redis_prefix) for k in redis.Redis.from_url(REDIS_URL).scan_iter(match=f"{redis_prefix}*")
    )


def test_per_key_read_limit_holds_across_replicas(replicas):
    urls, store = replicas
    key = store.create("tester", ["read"], read_limit="7/minute")[1]
    statuses = hammer(urls, "GET", "/models/m1", key, per_replica=8)
    assert statuses.count(200) == 7 and statuses.count(429) == 9, statuses
