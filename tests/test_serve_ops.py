"""Operations over real HTTP: admin endpoints, metrics, models/datasets/jobs listing, and `alloy submit merge`."""

from __future__ import annotations

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
    for name in ("alloy_jobs{", "alloy_job_queue_depth", "alloy_merge_bytes_per_second",
                 "alloy_model_cache_hit_rate", "alloy_http_requests_total", "alloy_http_request_duration_seconds"):
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

    result = CliRunner().invoke(cli, [
        "submit", "merge", "--models", "tune1", "tune3", "--strategy", "ties", "--base", "base",
        "--param", "density=0.5", "--output", "cli-merge",
        "--url", alloy_service.base_url, "--key", alloy_service.keys["write"],
    ])
    assert result.exit_code == 0, result.output
    assert "COMPLETED: model cli-merge" in result.output

    failed = CliRunner().invoke(cli, [
        "submit", "merge", "--models", "tune1", "ghost", "--strategy", "ties", "--output", "cli-x",
        "--url", alloy_service.base_url, "--key", alloy_service.keys["write"],
    ])
    assert failed.exit_code == 1
    assert "MODEL_NOT_FOUND" in failed.output


def test_merges_still_work_after_a_reload(alloy_service, served_models):
    admin = alloy_service.client("admin")
    assert admin.post("/admin/reload").status_code == 200
    # still the session's database and artifact folder: the registered models are all there
    assert admin.get("/models/tune1").status_code == 200
    accepted = admin.post("/merge/execute", json={"models": ["tune1", "tune2"], "strategy": "slerp",
                                                  "parameters": {"t": 0.5}, "output_model_id": "after-reload"})
    assert accepted.status_code == 202, accepted.text
    assert accepted.json()["progress_url"].startswith(alloy_service.base_url)
    assert alloy_service.wait_job(accepted.json()["progress_url"])["state"] == "COMPLETED"
