"""Real processes: a Ray cluster we start is killed with SIGKILL (every process of it, by pid) in the middle of
a merge; the next cold start's consistency check requeues the job, the replay reruns it, and it ends COMPLETED
with the registry consistent and no partial model left anywhere.

The Ray drivers run in their own processes (``tests/lifecycle_driver.py``) so this pytest process never joins
these clusters.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import psutil
import pytest

from alloy.artifacts import ArtifactStore
from alloy.db import Database
from alloy.jobs import JobState, JobStore
from alloy.recovery import Recovery
from alloy.registry.models import ModelRegistry

pytestmark = [pytest.mark.ray, pytest.mark.slow]

PROJECT_ROOT = Path(__file__).resolve().parents[1]
# Big enough that the merge takes a few seconds on a loaded 2-core machine: ~35M parameters per model.
MODEL_SHAPE = {"layers": 8, "hidden": 512, "vocab": 16000}


def _drive(phase: str, spec: dict, timeout_s: float) -> dict:
    spec_path = Path(spec["result_path"]).with_suffix(f".{phase}.spec.json")
    spec_path.write_text(json.dumps(spec))
    completed = subprocess.run([sys.executable, "-m", "tests.lifecycle_driver", phase, str(spec_path)],
                               cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=timeout_s)
    result = json.loads(Path(spec["result_path"]).read_text()) if Path(spec["result_path"]).exists() else {}
    assert completed.returncode == 0, f"{phase} driver failed:\n{completed.stdout[-3000:]}\n{completed.stderr[-5000:]}"
    return result


def _kill_tree(root_pid: int) -> int:
    """SIGKILL a process and every descendant (the whole Ray cluster we started), as an OOM killer or a power
    loss would: no signal handler, no shutdown hook runs."""
    try:
        root = psutil.Process(root_pid)
    except psutil.NoSuchProcess:
        return 0
    victims = [root, *root.children(recursive=True)]
    for process in victims:
        try:
            process.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    gone, alive = psutil.wait_procs(victims, timeout=20)
    assert not alive, f"survivors: {alive}"
    return len(victims)


@pytest.fixture
def cluster_spec(tmp_path, tiny_model_factory):
    data_dir = tmp_path / "var"
    settings = {"data_dir": str(data_dir), "model_roots": [str(tmp_path.parent), str(data_dir)],
                "database": {"url": f"sqlite:///{data_dir / 'alloy.db'}"},
                "artifacts": {"uri": str(tmp_path / "artifacts")}}
    data_dir.mkdir()
    db = Database(settings["database"]["url"])
    db.upgrade()
    base = tiny_model_factory("llama", seed=10, **MODEL_SHAPE)
    tune = tiny_model_factory("llama", seed=11, base=base, **MODEL_SHAPE)
    store = ArtifactStore(settings["artifacts"]["uri"])
    models = ModelRegistry(db, store, model_roots=[base.parent], data_dir=data_dir)
    models.register("big-a", base)
    models.register("big-b", tune)
    job = JobStore(db).create("merge", {"models": ["big-a", "big-b"], "strategy": "slerp",
                                        "parameters": {"t": 0.5}, "output_model_id": "big-merged"})
    temp_dirs: list[str] = []

    def ray_temp() -> str:  # short: Ray's socket paths are length-limited
        temp_dirs.append(tempfile.mkdtemp(prefix="alk", dir="/tmp"))
        return temp_dirs[-1]

    yield {"settings": settings, "job_id": job.id, "ray_temp_dir": ray_temp(), "new_ray_temp_dir": ray_temp,
           "db": db, "store": store, "models": models, "tmp": tmp_path}
    db.close()
    for folder in temp_dirs:
        shutil.rmtree(folder, ignore_errors=True)


def test_kill_9_of_the_whole_cluster_during_a_merge_then_restart_completes_it(cluster_spec):
    spec = {k: cluster_spec[k] for k in ("settings", "job_id", "ray_temp_dir")}
    tmp = cluster_spec["tmp"]
    jobs = JobStore(cluster_spec["db"])
    head_pid = None
    try:
        submitted = _drive("submit", {**spec, "result_path": str(tmp / "submit.json")}, timeout_s=420)
        head_pid = submitted["head_pid"]
        killed = _kill_tree(head_pid)
        head_pid = None
    finally:
        if head_pid is not None:
            _kill_tree(head_pid)
    assert submitted["seen"] == "RUNNING", "the merge finished before the kill: make MODEL_SHAPE bigger"
    assert killed > 5  # ray start, GCS, raylet, dashboard, workers: the whole cluster
    assert jobs.get(spec["job_id"]).state is JobState.RUNNING  # nobody could record anything
    assert not cluster_spec["models"].exists("big-merged")

    restarted = _drive("start", {**spec, "ray_temp_dir": cluster_spec["new_ray_temp_dir"](),
                                 "result_path": str(tmp / "start.json")}, timeout_s=420)

    steps = [(s["name"], s["status"]) for s in restarted["start"]["steps"]]
    assert steps == [("load configuration", "ok"), ("validate dependencies", "ok"), ("connect registries", "ok"),
                     ("consistency check", "ok"), ("initialise worker pools", "ok"),
                     ("health-check endpoints", "ok"), ("mark READY", "ok"), ("replay interrupted jobs", "ok")]
    interrupted = restarted["consistency"]["interrupted_jobs"]
    assert [(j["id"], j["state"]) for j in interrupted] == [(spec["job_id"], "RUNNING")]
    assert restarted["final_state"] == "COMPLETED"

    job = jobs.get(spec["job_id"])
    assert job.state is JobState.COMPLETED and job.attempts == 1 and job.result["model_id"] == "big-merged"
    events = [e.event for e in jobs.events(spec["job_id"])]
    assert "interrupted" in events and events.index("replayed") > events.index("interrupted")
    record = cluster_spec["models"].get("big-merged")
    assert record.lineage["job_id"] == spec["job_id"]
    # Registry consistent, no partial model: nothing orphaned, broken, staged or left in the merge scratch.
    report = Recovery(cluster_spec["db"], cluster_spec["store"], models=cluster_spec["models"],
                      scratch_dirs=[Path(spec["settings"]["data_dir"]) / "work" / "merges"]).check()
    assert report.consistent, report.summary()
    print("start steps (s):", {s["name"]: s["duration_s"] for s in restarted["start"]["steps"]})


def test_graceful_stop_waits_for_the_active_merge_and_finishes_it(cluster_spec):
    spec = {k: cluster_spec[k] for k in ("settings", "job_id", "ray_temp_dir")}
    result = _drive("stop", {**spec, "timeout_s": 300, "result_path": str(cluster_spec["tmp"] / "stop.json")},
                    timeout_s=420)
    assert result["seen"] == "RUNNING"
    report = result["report"]
    assert report["run"]["mode"] == "graceful" and report["run"]["ok"] and not report["escalated"]
    assert report["waited_for"] == [spec["job_id"]]
    assert result["job_state_at_terminate"] == "COMPLETED"  # the pools went only after the merge finished
    assert result["cluster"] == "STOPPED"
    assert cluster_spec["models"].get("big-merged").lineage["job_id"] == spec["job_id"]
    print("graceful stop steps (s):", {s["name"]: s["duration_s"] for s in report["run"]["steps"]})


def test_stop_with_a_1s_timeout_forces_and_the_job_is_replayable(cluster_spec):
    spec = {k: cluster_spec[k] for k in ("settings", "job_id", "ray_temp_dir")}
    result = _drive("stop", {**spec, "timeout_s": 1, "result_path": str(cluster_spec["tmp"] / "stop.json")},
                    timeout_s=420)
    assert result["seen"] == "RUNNING"
    report = result["report"]
    assert report["escalated"] and report["run"]["mode"] == "graceful->forced" and not report["run"]["ok"]
    assert report["unfinished"] == [spec["job_id"]] or result["final_job_state"] == "CREATED"
    assert [s["name"] for s in report["run"]["steps"]][:3] == [
        "reject submissions", "wait for active merges and evaluations", "cancel active tasks"]
    assert result["cluster"] == "STOPPED"
    jobs = JobStore(cluster_spec["db"])
    job = jobs.get(spec["job_id"])
    assert job.state is JobState.CREATED and jobs.events(job.id)[-1].event == "interrupted"
    assert not cluster_spec["models"].exists("big-merged")  # no partial model registered
    report = Recovery(cluster_spec["db"], cluster_spec["store"], models=cluster_spec["models"],
                      scratch_dirs=[Path(spec["settings"]["data_dir"]) / "work" / "merges"]).check()
    assert not report.orphan_artifacts and not report.broken_records and report.staging_leftovers == 0
    print("forced stop steps (s):", {s["name"]: s["duration_s"] for s in result["report"]["run"]["steps"]})
