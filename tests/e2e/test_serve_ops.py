"""Operations over real HTTP: admin endpoints, metrics, models/datasets/jobs listing, and `alloy submit merge`."""

from __future__ import annotations

import threading
import time
import uuid

import pytest
from click.testing import CliRunner

pytestmark = pytest.mark.ray


def test_admin_reload_flush_cache_and_metrics(alloy_service, served_models):
    admin = alloy_service.client("admin")
    before = admin.get("/health").json()["config_version"]
    reloaded = admin.post("/admin/reload")
    assert reloaded.status_code == 200, reloaded.text
    assert reloaded.json()["config_version"] == before + 1
    assert admin.get("/health").json()["config_version"] == before + 1

    first = admin.post("/admin/flush").json()["lsn"]
    assert isinstance(first, int) and admin.post("/admin/flush").json()["lsn"] >= first

    drained = admin.post("/admin/drain", json={})
    assert drained.status_code == 409  # a one-node cluster has no worker to drain; the head cannot be drained
    assert "head node cannot be drained" in drained.json()["error"]["message"]

    metrics = admin.get("/metrics")
    assert metrics.status_code == 200 and metrics.headers["content-type"].startswith("text/plain")
    text = metrics.text
    for name in (
        "alloy_jobs{",
        "alloy_job_queue_depth",
        "alloy_merge_bytes_per_second",
        "alloy_model_cache_hit_rate",
        "alloy_http_requests_total",
        "alloy_http_request_duration_seconds",
    ):
        assert name in text, name
    assert 'alloy_jobs{kind="merge",state="COMPLETED"}' in text

    cleared = admin.delete("/admin/cache")
    assert cleared.status_code == 200, cleared.text
    assert cleared.json()["caches"]["MergeEngine"]["hit_rate"] == 0.0
    assert 'alloy_model_cache_hit_rate{component="MergeEngine"} 0.0' in admin.get("/metrics").text


def test_models_listing_and_delete(alloy_service, served_models):
    reader = alloy_service.client("read")
    listed = reader.get("/models", params={"limit": 500}).json()
    assert {"base", "tune1", "gpt"} <= {m["id"] for m in listed["items"]}
    assert reader.get("/models/ghost").status_code == 404
    writer = alloy_service.client("write")
    alloy_service.register_model("doomed-model", served_models["tune3"])
    assert writer.delete("/models/doomed-model").status_code == 204
    assert reader.get("/models/doomed-model").status_code == 404
    assert reader.get("/datasets").status_code == 200
    assert reader.get("/experiments").status_code == 200


def test_alloy_submit_merge_follows_to_completed(alloy_service, served_models):
    from alloy.cli.main import cli

    result = CliRunner().invoke(
        cli,
        [
            "submit",
            "merge",
            "--models",
            "tune1",
            "tune3",
            "--strategy",
            "ties",
            "--base",
            "base",
            "--param",
            "density=0.5",
            "--output",
            "cli-merge",
            "--url",
            alloy_service.base_url,
            "--key",
            alloy_service.keys["write"],
        ],
    )
    assert result.exit_code == 0, result.output
    assert "COMPLETED: model cli-merge" in result.output

    failed = CliRunner().invoke(
        cli,
        [
            "submit",
            "merge",
            "--models",
            "tune1",
            "ghost",
            "--strategy",
            "ties",
            "--output",
            "cli-x",
            "--url",
            alloy_service.base_url,
            "--key",
            alloy_service.keys["write"],
        ],
    )
    assert failed.exit_code == 1
    assert "MODEL_NOT_FOUND" in failed.output


def test_merges_still_work_after_a_reload(alloy_service, served_models):
    admin = alloy_service.client("admin")
    assert admin.post("/admin/reload").status_code == 200
    # still the session's database and artifact folder: the registered models are all there
    assert admin.get("/models/tune1").status_code == 200
    accepted = admin.post(
        "/merge/execute",
        json={
            "models": ["tune1", "tune2"],
            "strategy": "slerp",
            "parameters": {"t": 0.5},
            "output_model_id": "after-reload",
        },
    )
    assert accepted.status_code == 202, accepted.text
    assert accepted.json()["progress_url"].startswith(alloy_service.base_url)
    assert alloy_service.wait_job(accepted.json()["progress_url"])["state"] == "COMPLETED"


# --- the cluster-state gate and reload/drain under load -------------------------------------------------------

GATE_TTL_S = 1.2  # the ingress reads the state at most once a second (CachedClusterState)
MAX_LOAD_MERGES = 4  # enough to overlap the reloads; each must finish afterwards


def _cluster_store(alloy_service):
    from alloy.cluster.state import ClusterStateStore
    from alloy.storage.db import Database

    return ClusterStateStore(Database(alloy_service.database_url))


def _merge_body(output: str) -> dict:
    return {"models": ["tune1", "tune2"], "strategy": "slerp", "parameters": {"t": 0.5}, "output_model_id": output}


def test_the_gate_answers_503_before_ready_and_refuses_submissions_while_draining(alloy_service, served_models):
    from alloy.cluster.state import ClusterState

    store = _cluster_store(alloy_service)
    admin = alloy_service.client("admin")
    assert store.state() is ClusterState.READY  # the fixture's cold start ended READY
    try:
        store.transition(ClusterState.DRAINING)
        time.sleep(GATE_TTL_S)
        refused = admin.post("/merge/execute", json=_merge_body("while-draining"))
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["code"] == "SERVICE_UNAVAILABLE"
        assert refused.json()["error"]["details"] == {"cluster_state": "DRAINING", "retryable": False}
        assert admin.get("/models/tune1").status_code == 200  # reads (progress polling) keep working
        health = admin.get("/health")
        assert health.status_code == 200 and health.json()["cluster_state"] == "DRAINING"  # read, never reset

        store.begin_start("warm")  # a start in progress: nothing but /health and /metrics is served
        time.sleep(GATE_TTL_S)
        starting = admin.get("/models/tune1")
        assert starting.status_code == 503 and starting.json()["error"]["details"]["cluster_state"] == "STARTING"
        assert admin.get("/health").json()["cluster_state"] == "STARTING"
        assert 'alloy_cluster_state{state="STARTING"} 1.0' in admin.get("/metrics").text
    finally:
        if store.state() is not ClusterState.STARTING:
            store.begin_start("warm")
        store.mark_ready()
        time.sleep(GATE_TTL_S)
    assert 'alloy_cluster_state{state="READY"} 1.0' in admin.get("/metrics").text
    assert admin.post("/merge/execute", json=_merge_body("after-ready")).status_code == 202


class _Load:
    """Progress polls and merge submissions from threads, recording every status code."""

    def __init__(self, alloy_service, job_url: str):
        self.service, self.job_url = alloy_service, job_url
        self.codes: list[tuple[str, int]] = []
        self.accepted: list[str] = []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._poll, daemon=True) for _ in range(3)]
        self.threads.append(threading.Thread(target=self._submit, daemon=True))

    def __enter__(self):
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *_):
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=120)

    def _poll(self) -> None:
        client = self.service.client("read")
        while not self.stop.is_set():
            self.codes.append(("poll", client.get(self.job_url).status_code))

    def _submit(self) -> None:
        client = self.service.client("write")
        while not self.stop.is_set() and len(self.accepted) < MAX_LOAD_MERGES:
            response = client.post("/merge/execute", json=_merge_body(f"load-{uuid.uuid4().hex[:8]}"))
            self.codes.append(("submit", response.status_code))
            if response.status_code == 202:
                self.accepted.append(response.json()["progress_url"])
            time.sleep(0.5)

    def server_errors(self) -> list[tuple[str, int]]:
        return [(kind, code) for kind, code in self.codes if code >= 500]


def test_reload_and_drain_under_load(alloy_service, served_models):
    """Reloads and a drain request while progress polls and merge submissions run: no 5xx, every reload
    increments the version. On this single-node cluster the drain is refused (409 CONFLICT naming why: Ray's
    GCS DrainNode cannot drain the head node and there is no worker node), and nothing else changes."""
    admin = alloy_service.client("admin")
    first = admin.post("/merge/execute", json=_merge_body(f"load-{uuid.uuid4().hex[:8]}"))
    assert first.status_code == 202, first.text
    with _Load(alloy_service, first.json()["progress_url"]) as load:
        time.sleep(1.0)
        versions = []
        for _ in range(3):
            reloaded = admin.post("/admin/reload")
            assert reloaded.status_code == 200, reloaded.text
            versions.append(reloaded.json()["config_version"])
            time.sleep(0.5)
        drained = admin.post("/admin/drain", json={"reason": "maintenance"})
        time.sleep(1.0)
    assert versions == sorted(versions) and len(set(versions)) == 3 and versions[1] == versions[0] + 1
    assert admin.get("/health").json()["config_version"] >= versions[-1]
    assert drained.status_code == 409, drained.text
    assert drained.json()["error"]["code"] == "CONFLICT"
    assert "head node cannot be drained" in drained.json()["error"]["message"]
    assert admin.get("/health").json()["draining_nodes"] == []
    assert not load.server_errors(), load.server_errors()
    assert {kind for kind, _ in load.codes} == {"poll", "submit"} and load.accepted
    for url in load.accepted:  # every merge accepted under load finishes
        assert alloy_service.wait_job(url)["state"] == "COMPLETED"
