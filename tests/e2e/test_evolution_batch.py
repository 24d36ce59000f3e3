"""``ray job submit`` of the batch evolution onto the session cluster, exactly as docs/EVOLUTION.md tells an
operator (token auth via ``RAY_AUTH_MODE`` / ``RAY_AUTH_TOKEN``, ``--working-dir .``), with ``ALLOY_*`` settings
in the runtime env pointing the driver at the session service's database and artifact folder; the job, its
trials and the evolved model are then read back through the HTTP API."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.e2e.test_evolution_engine import FRESH_CANDIDATES, service_env
from tests.e2e.test_evolution_http import PROJECT_ROOT

pytestmark = pytest.mark.ray

RAY_CLI = str(Path(sys.executable).with_name("ray"))
# Never uploaded with --working-dir (.gitignore already lists them; Ray honours it, this makes it explicit).
UPLOAD_EXCLUDES = [".venv", "var", "bench/out", ".git", "**/__pycache__", "*.egg-info", ".pytest_cache"]


def submit(
    dashboard_url: str, env: dict[str, str], submission_id: str, entrypoint: list[str], runtime_env: dict
) -> subprocess.CompletedProcess:
    command = [
        RAY_CLI,
        "job",
        "submit",
        "--address",
        dashboard_url,
        "--submission-id",
        submission_id,
        "--working-dir",
        ".",
        "--runtime-env-json",
        json.dumps(runtime_env),
        "--no-wait",
        "--",
        *entrypoint,
    ]
    return subprocess.run(command, cwd=PROJECT_ROOT, env=env, capture_output=True, text=True, timeout=180)


def wait_for_ray_job(client, submission_id: str, timeout_s: float = 300.0):
    from ray.job_submission import JobStatus

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = client.get_job_status(submission_id)
        if status in (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED):
            return status
        time.sleep(1.0)
    raise AssertionError(f"ray job {submission_id} still running after {timeout_s}s")


def test_ray_job_submit_runs_the_tiny_evolution_visible_through_the_api(alloy_service, ray_cluster):
    from ray.job_submission import JobStatus, JobSubmissionClient

    env = {**os.environ, **ray_cluster.env}  # RAY_AUTH_MODE=token + RAY_AUTH_TOKEN: the CLI sends the token
    env.pop("RAY_ADDRESS", None)  # --address names the dashboard; nothing else points the CLI anywhere
    submission_id = f"alloy-evolve-tiny-{uuid.uuid4().hex[:8]}"
    runtime_env = {"env_vars": {**service_env(alloy_service), "HF_HUB_OFFLINE": "1"}, "excludes": UPLOAD_EXCLUDES}
    # sys.executable: the project's interpreter (CI runs the tests without activating the venv)
    submitted = submit(
        ray_cluster.dashboard_url,
        env,
        submission_id,
        [sys.executable, "-m", "evolution.run", "configs/evolve-tiny.yaml"],
        runtime_env,
    )
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr

    jobs = JobSubmissionClient(ray_cluster.dashboard_url)  # token from this process's env (the fixture's)
    status = wait_for_ray_job(jobs, submission_id)
    logs = jobs.get_job_logs(submission_id)
    assert status == JobStatus.SUCCEEDED, logs[-3000:]
    info = jobs.get_job_info(submission_id)  # what the Ray dashboard shows
    assert info.entrypoint.endswith("configs/evolve-tiny.yaml")

    job_id = re.search(r"evolution job ([0-9a-f]{32})", logs).group(1)
    client = alloy_service.client("read")
    view = client.get(f"/evolutions/{job_id}").json()
    assert view["state"] == "COMPLETED" and view["trials"] == FRESH_CANDIDATES, view
    assert view["generation"] == 3 and view["best_fitness"] >= view["median_fitness"]
    trials = client.get(f"/evolutions/{job_id}/trials").json()
    assert trials["count"] == FRESH_CANDIDATES
    model = client.get(f"/models/{view['result']['model_id']}")
    assert model.status_code == 200 and model.json()["lineage"]["job_id"] == job_id
    job = client.get(f"/jobs/{job_id}")
    assert job.status_code == 200 and job.json()["kind"] == "evolution"
