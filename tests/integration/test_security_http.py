"""Authentication, scopes, rate limits, body limits and rotation through real HTTP: a real uvicorn server on
loopback, a real SQLite key store, the ``limits`` in-memory storage (one replica)."""

from __future__ import annotations

import logging
import time
from datetime import datetime, timedelta, timezone

import httpx
import pytest

from alloy.storage.db import Database
from alloy.storage.keys import ApiKeyStore
from tests.security_helpers import build_test_app, make_settings, serve_in_thread

RATE_HEADERS = ("x-ratelimit-limit", "x-ratelimit-remaining", "x-ratelimit-reset")
MERGE_BODY = {"models": ["base", "org/tuned-1.5"], "strategy": "slerp", "output_model": "merged"}


@pytest.fixture(scope="module")
def db_url(tmp_path_factory):
    url = f"sqlite:///{tmp_path_factory.mktemp('security') / 'alloy.db'}"
    Database(url).upgrade()
    return url


@pytest.fixture(scope="module")
def store(db_url):
    return ApiKeyStore(Database(db_url))


@pytest.fixture(scope="module")
def base_url(db_url):
    with serve_in_thread(build_test_app(make_settings(), db_url)) as url:
        yield url


@pytest.fixture
def client(base_url):
    with httpx.Client(base_url=base_url, timeout=10) as session:
        yield session


@pytest.fixture
def make_key(store):
    def make(*scopes: str, **kwargs) -> str:
        return store.create("tester", scopes or ("write",), **kwargs)[1]

    return make


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def assert_rate_headers(response: httpx.Response) -> None:
    for name in RATE_HEADERS:
        assert name in response.headers, f"{name} missing on {response.status_code}"
        assert int(response.headers[name]) >= 0


def assert_error(response: httpx.Response, status: int, code: str) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"code", "message", "details", "request_id"}
    assert body["error"]["code"] == code
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    assert isinstance(body["error"]["details"], dict)
    assert body["error"]["request_id"] == response.headers["x-request-id"]
    assert_rate_headers(response)
    return body["error"]


# -- authentication ------------------------------------------------------------------------------------------
def test_missing_key_is_401_with_challenge(client):
    response = client.get("/models/m1")
    assert_error(response, 401, "UNAUTHENTICATED")
    assert response.headers["www-authenticate"] == "Bearer"


@pytest.mark.parametrize(
    "headers",
    [
        {"Authorization": "Bearer alloy_0123456789abcdef_AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA"},
        {"X-API-Key": "not-a-key"},
        {"Authorization": "Basic dXNlcjpwYXNz"},  # another scheme carries no API key
        {"Authorization": "Bearer"},
    ],
)
def test_invalid_keys_are_401(client, headers):
    assert_error(client.get("/models/m1", headers=headers), 401, "UNAUTHENTICATED")


def test_wrong_secret_for_a_real_key_id_is_401(client, make_key):
    key = make_key("read")
    tampered = key[:-2] + ("AA" if not key.endswith("AA") else "BB")
    assert_error(client.get("/models/m1", headers=bearer(tampered)), 401, "UNAUTHENTICATED")


def test_bearer_and_x_api_key_both_authenticate(client, make_key):
    key = make_key("read")
    for headers in (bearer(key), {"X-API-Key": key}):
        response = client.get("/models/m1", headers=headers)
        assert response.status_code == 200, response.text
        assert response.json() == {"id": "m1", "owner": "tester"}
        assert_rate_headers(response)


def test_revoked_and_expired_keys_are_401(client, store, make_key):
    revoked = make_key("read")
    assert client.get("/models/m1", headers=bearer(revoked)).status_code == 200
    store.revoke(revoked.split("_")[1])
    assert_error(client.get("/models/m1", headers=bearer(revoked)), 401, "UNAUTHENTICATED")
    expired = make_key("read", expires_at=datetime.now(timezone.utc) - timedelta(seconds=1))
    assert_error(client.get("/models/m1", headers=bearer(expired)), 401, "UNAUTHENTICATED")


def test_only_the_api_description_is_public(client):
    response = client.get("/openapi.json")
    assert response.status_code == 200
    assert_rate_headers(response)
    assert "BearerAuth" in response.json()["components"]["securitySchemes"]
    assert client.get("/docs").status_code == 200
    assert_error(client.get("/health"), 401, "UNAUTHENTICATED")


# -- scopes --------------------------------------------------------------------------------------------------
def test_read_scope_cannot_write(client, make_key):
    key = make_key("read")
    error = assert_error(client.post("/notes", json={"a": "b"}, headers=bearer(key)), 403, "FORBIDDEN")
    assert error["details"]["required_scope"] == "write"
    assert_error(client.post("/merge/execute", json=MERGE_BODY, headers=bearer(key)), 403, "FORBIDDEN")


def test_admin_paths_need_admin_scope(client, make_key):
    writer, admin = make_key("write"), make_key("admin")
    assert_error(client.post("/admin/flush", headers=bearer(writer)), 403, "FORBIDDEN")
    assert_error(client.post("/admin/no-such-route", headers=bearer(writer)), 403, "FORBIDDEN")  # no probing
    assert client.post("/admin/flush", headers=bearer(admin)).json() == {"lsn": 1}
    # admin implies write and read
    assert client.post("/notes", json={"a": "b"}, headers=bearer(admin)).status_code == 200
    assert client.get("/models/m1", headers=bearer(admin)).status_code == 200


# -- rate limits ---------------------------------------------------------------------------------------------
def test_default_limits_are_reported(client, make_key):
    key = make_key("write")
    read = client.get("/models/m1", headers=bearer(key))
    assert (read.headers["x-ratelimit-limit"], read.headers["x-ratelimit-remaining"]) == ("100", "99")
    job = client.post("/merge/execute", json=MERGE_BODY, headers=bearer(key))
    assert job.status_code == 202, job.text
    assert (job.headers["x-ratelimit-limit"], job.headers["x-ratelimit-remaining"]) == ("10", "9")
    assert 0 < int(job.headers["x-ratelimit-reset"]) <= 60


def test_read_limit_allows_exactly_the_limit(client, make_key):
    key = make_key("read", read_limit="5/minute")
    remaining = []
    for _ in range(5):
        response = client.get("/models/m1", headers=bearer(key))
        assert response.status_code == 200
        remaining.append(int(response.headers["x-ratelimit-remaining"]))
    assert remaining == [4, 3, 2, 1, 0]
    over = client.get("/models/m1", headers=bearer(key))
    error = assert_error(over, 429, "QUOTA_EXCEEDED")
    retry_after = int(over.headers["retry-after"])
    assert 1 <= retry_after <= 60
    assert over.headers["x-ratelimit-remaining"] == "0"
    assert abs(int(over.headers["x-ratelimit-reset"]) - retry_after) <= 1
    assert error["details"]["bucket"] == "read"
    # errors count too, and headers stay on them: unknown route while limited is still 429
    assert_error(client.get("/nowhere", headers=bearer(key)), 429, "QUOTA_EXCEEDED")


def test_jobs_bucket_is_separate_and_per_key(client, make_key):
    key, other = make_key("write", jobs_limit="2/minute"), make_key("write", jobs_limit="2/minute")
    statuses = [client.post("/merge/execute", json=MERGE_BODY, headers=bearer(key)).status_code for _ in range(3)]
    assert statuses == [202, 202, 429]
    assert client.get("/models/m1", headers=bearer(key)).status_code == 200  # reads unaffected
    assert client.post("/notes", json={"a": "b"}, headers=bearer(key)).status_code == 200  # other writes: read bucket
    assert client.post("/merge/execute", json=MERGE_BODY, headers=bearer(other)).status_code == 202


def test_rate_window_moves(db_url, store):
    """A 2-per-2-seconds key: the third request waits until the first leaves the window."""
    key = store.create("tester", ["read"], read_limit="2/2 seconds")[1]
    with serve_in_thread(build_test_app(make_settings(), db_url)) as url, httpx.Client(base_url=url) as client:
        assert [client.get("/models/m", headers=bearer(key)).status_code for _ in range(3)] == [200, 200, 429]
        time.sleep(2.1)
        assert client.get("/models/m", headers=bearer(key)).status_code == 200


def test_anonymous_requests_are_throttled_per_client(db_url):
    app = build_test_app(make_settings(anonymous="3/minute"), db_url)
    with serve_in_thread(app) as url, httpx.Client(base_url=url) as client:
        # wait_until_up already spent one anonymous request on /openapi.json
        statuses = [client.get("/models/m", headers={"X-API-Key": f"guess-{i}"}).status_code for i in range(3)]
        assert statuses == [401, 401, 429]
        assert_error(client.get("/models/m"), 429, "QUOTA_EXCEEDED")


# -- body limits ---------------------------------------------------------------------------------------------
def test_body_over_limit_by_content_length_is_413(client, make_key):
    key = make_key("write")
    error = assert_error(client.post("/notes", content=b"x" * 2048, headers=bearer(key)), 413, "PAYLOAD_TOO_LARGE")
    assert error["details"]["limit_bytes"] == 1024


def test_chunked_body_over_limit_is_413(client, make_key):
    key = make_key("write")

    def chunks(total: int):
        for _ in range(total // 256):
            yield b"y" * 256

    ok = client.post("/upload", content=chunks(1024), headers=bearer(key))
    assert ok.status_code == 200 and ok.json() == {"size": 1024}
    assert "content-length" not in ok.request.headers  # really chunked
    assert_error(client.post("/upload", content=chunks(4096), headers=bearer(key)), 413, "PAYLOAD_TOO_LARGE")
    assert_error(client.post("/merge/execute", content=chunks(4096), headers=bearer(key)), 413, "PAYLOAD_TOO_LARGE")


# -- rotation ------------------------------------------------------------------------------------------------
def test_rotated_key_works_until_grace_ends(client, store, make_key):
    old = make_key("read")
    record, new = store.rotate(old.split("_")[1], grace_seconds=1)
    assert client.get("/models/m1", headers=bearer(old)).status_code == 200
    assert client.get("/models/m1", headers=bearer(new)).status_code == 200
    time.sleep(1.2)
    assert_error(client.get("/models/m1", headers=bearer(old)), 401, "UNAUTHENTICATED")
    assert client.get("/models/m1", headers=bearer(new)).status_code == 200


# -- secrets -------------------------------------------------------------------------------------------------
def test_keys_never_reach_the_logs(client, make_key, caplog):
    caplog.set_level(logging.DEBUG)
    key = make_key("read")
    bad = key[:-3] + "zzz"
    client.get("/models/m1", headers=bearer(key))
    client.get("/crash", headers={"X-API-Key": key})
    client.get("/models/m1", headers=bearer(bad))
    logged = "\n".join(record.getMessage() + (record.exc_text or "") for record in caplog.records)
    assert "unhandled error" in logged  # the crash was logged...
    assert key not in logged and bad not in logged  # ...without the key
