"""alloy.client against the real Serve app (session fixtures): a merge followed to COMPLETED through its live
events, model listing and download with Range resume, every failure as one AlloyAPIError with the service's
code, the async client, and the import boundary (the client never imports the server)."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from alloy.client import AlloyAPIError, AsyncClient, Client
from alloy.client._common import best_trial

pytestmark = pytest.mark.ray


@pytest.fixture
def client(alloy_service):
    with Client(alloy_service.base_url, alloy_service.keys["write"], timeout=120) as alloy:
        yield alloy


def test_merge_wait_and_download_with_resume(client, served_models, tmp_path):
    job = client.merge(["tune1", "tune2"], "ties", "client-merged", base_model="base", parameters={"density": 0.5})
    seen = [event.event for event in job.events()]
    assert seen[-1] == "end" and seen.count("state") == 4
    view = job.wait(progress=True)
    assert view.state.value == "COMPLETED" and view.model_id == "client-merged" and view.percent == 100.0
    assert [e.to_state.value for e in job.history()] == ["CREATED", "PREPARING", "RUNNING", "COMPLETED"]

    assert "client-merged" in [m.id for m in client.models(limit=500).items]
    assert client.model("client-merged").lineage["job_id"] == job.id
    files = client.download_model("client-merged", tmp_path / "out")
    weights = next(p for p in files if p.suffix == ".safetensors")
    whole = weights.read_bytes()
    # An interrupted download: keep the first third, download again, the rest is fetched with a Range request.
    weights.write_bytes(whole[: len(whole) // 3])
    key = next(a.key for a in client.artifacts("models/client-merged/") if a.key.endswith(weights.name))
    client.download(key, weights)
    assert weights.read_bytes() == whole


def test_range_requests_on_the_wire(alloy_service, client, served_models):
    key = next(a.key for a in client.artifacts("models/") if a.key.endswith(".json"))
    raw = alloy_service.client("read")
    whole = raw.get(f"/artifacts/{key}/content")
    part = raw.get(f"/artifacts/{key}/content", headers={"Range": "bytes=5-"})
    assert whole.status_code == 200 and whole.headers["accept-ranges"] == "bytes"
    assert part.status_code == 206 and part.content == whole.content[5:]
    assert part.headers["content-range"] == f"bytes 5-{len(whole.content) - 1}/{len(whole.content)}"
    refused = raw.get(f"/artifacts/{key}/content", headers={"Range": "bytes=0-3,7-9"})
    assert refused.status_code == 422 and refused.json()["error"]["code"] == "VALIDATION_FAILED"


@pytest.mark.parametrize(
    "call, code, status",
    [
        (lambda c: c.merge(["tune1", "tune2"], "blend", "x1"), "INVALID_STRATEGY", 422),
        (lambda c: c.merge(["tune1", "ghost"], "slerp", "x2", parameters={"t": 0.5}), "MODEL_NOT_FOUND", 404),
        (lambda c: c.merge(["tune1", "tune2"], "slerp", "bad id!"), "VALIDATION_FAILED", 422),  # refused locally
        (lambda c: c.job("no-such-job"), "NOT_FOUND", 404),
        (lambda c: c.model("ghost-model"), "MODEL_NOT_FOUND", 404),
    ],
)
def test_failures_are_alloy_api_errors_with_the_service_code(client, served_models, call, code, status):
    with pytest.raises(AlloyAPIError) as caught:
        call(client)
    assert (caught.value.code, caught.value.status) == (code, status)
    assert caught.value.message


def test_missing_key_and_dead_server(alloy_service, monkeypatch):
    monkeypatch.delenv("ALLOY_API_KEY", raising=False)
    with Client(alloy_service.base_url) as anonymous, pytest.raises(AlloyAPIError) as caught:
        anonymous.jobs()
    assert (caught.value.code, caught.value.status) == ("UNAUTHENTICATED", 401)
    with Client("http://127.0.0.1:9", "k") as dead, pytest.raises(AlloyAPIError) as caught:
        dead.jobs()
    assert caught.value.code == "SERVICE_UNAVAILABLE" and "127.0.0.1:9" in caught.value.message


def test_url_and_key_come_from_the_environment(alloy_service, monkeypatch):
    monkeypatch.setenv("ALLOY_URL", alloy_service.base_url)
    monkeypatch.setenv("ALLOY_API_KEY", alloy_service.keys["read"])
    with Client() as alloy:
        assert alloy.jobs(limit=1).limit == 1


def test_async_client_merges_and_waits(alloy_service, served_models):
    async def scenario():
        async with AsyncClient(alloy_service.base_url, alloy_service.keys["write"], timeout=120) as alloy:
            job = await alloy.merge(
                ["tune1", "tune3"], "task_arithmetic", "async-merged", base_model="base", parameters={"weight": 0.5}
            )
            view = await job.wait()
            with pytest.raises(AlloyAPIError) as caught:
                await alloy.model("ghost-model")
            return view, caught.value.code

    view, code = asyncio.run(scenario())
    assert view.state.value == "COMPLETED" and view.model_id == "async-merged"
    assert code == "MODEL_NOT_FOUND"


def test_best_trial_is_the_highest_fitness():
    trials = [
        {"trial_id": "a", "metrics": {"fitness": 0.2}},
        {"trial_id": "b", "metrics": {"fitness": 0.7}},
        {"trial_id": "c", "metrics": {}},
    ]
    assert best_trial(trials)["trial_id"] == "b"
    assert best_trial([]) is None


def test_the_client_imports_no_server_code():
    probe = (
        "import sys, alloy.client; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'fastapi', 'ray', 'starlette', 'uvicorn'}))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_keys_created_listed_and_revoked_over_http(alloy_service):
    with Client(alloy_service.base_url, alloy_service.keys["admin"]) as admin:
        new = admin.create_key("client-test", ["read"], read_limit="50/minute")
        assert new.key and new.status == "active" and new.scopes == ["read"]
        assert new.key_id in {k.key_id for k in admin.keys()}
        assert all(not hasattr(k, "key") for k in admin.keys())  # listings never carry secrets
        with Client(alloy_service.base_url, new.key) as reader:
            assert reader.jobs(limit=1).limit == 1
            with pytest.raises(AlloyAPIError) as caught:
                reader.keys()
            assert (caught.value.code, caught.value.status) == ("FORBIDDEN", 403)
            assert admin.revoke_key(new.key_id).status == "revoked"
            with pytest.raises(AlloyAPIError) as caught:
                reader.jobs()
            assert caught.value.code == "UNAUTHENTICATED"
        with pytest.raises(AlloyAPIError) as caught:
            admin.create_key("x", ["root"])
        assert caught.value.code == "VALIDATION_FAILED"
        with pytest.raises(AlloyAPIError) as caught:
            admin.revoke_key("no-such-key")
        assert caught.value.code == "NOT_FOUND"
