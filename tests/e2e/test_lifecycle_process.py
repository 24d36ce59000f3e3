"""Real processes, through the real CLI: `alloy start` runs in the background on a data dir of its own (its own
Ray head, its own token), merges are submitted over HTTP, and `alloy stop` / `alloy status` are run as an
operator would. The tests run in file order on one story, so three Ray clusters cover all four behaviours:

1. `alloy start`; a merge runs; every process of that cluster (the `alloy start` process, the Ray head and all
   its children) gets SIGKILL. `alloy start` again: its consistency check requeues the merge, the replay
   reruns it, and it ends COMPLETED with the registry consistent and no partial model anywhere.
2. On that same cluster: a merge is submitted and `alloy stop` waits for it, then finishes the stop (STOPPED).
3. `alloy start --warm --skip-dependency-checks` restores the pools saved at that stop; a merge is submitted and
   `alloy stop --timeout 1` escalates to a forced stop (exit 2): the merge is requeued with an ``interrupted``
   event and nothing partial is left.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil
import pytest
import yaml

from alloy.cluster.recovery import Recovery
from alloy.cluster.state import ClusterState, ClusterStateStore
from alloy.jobs.records import JobState
from alloy.jobs.store import JobStore
from alloy.registry.models import ModelRegistry
from alloy.storage.artifacts import ArtifactStore
from alloy.storage.db import Database

pytestmark = [pytest.mark.ray, pytest.mark.slow]

PROJECT_ROOT = Path(__file__).resolve().parents[2]
ALLOY = str(Path(sys.executable).with_name("alloy"))
# Big enough that a merge takes seconds on a loaded 2-core machine: ~35M parameters per model.
MODEL_SHAPE = {"layers": 8, "hidden": 512, "vocab": 16000}
READY_TIMEOUT_S = 420
# A merge of these models takes ~2 s, less than `alloy stop` needs to start on a loaded machine: the stop tests
# queue several, so some are still active when the stop begins however slow the CLI is.
QUEUED_MERGES = 6
READY_LINE = re.compile(r"export ALLOY_URL=(\S+) ALLOY_API_KEY=(\$\(cat \S+\)|\S+)")
# The session cluster's address and token must not leak into the clusters these tests start.
LEAKY_ENV = ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN")


@dataclass
class Operator:
    """Runs the alloy CLI on one config file, as an operator in a shell would."""

    root: Path
    config_file: Path
    data_dir: Path
    db: Database
    models: ModelRegistry
    store: ArtifactStore
    url: str = ""
    key: str = ""
    process: subprocess.Popen | None = None
    logs: list[Path] = field(default_factory=list)

    @property
    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in LEAKY_ENV}
        return {**env, "ALLOY_CONFIG": str(self.config_file), "PYTHONUNBUFFERED": "1"}

    def start(self, *flags: str) -> None:
        """`alloy start FLAGS` in the background; returns once it printed its URL and key (READY)."""
        log = self.root / f"start-{len(self.logs)}.log"
        self.logs.append(log)
        self.process = subprocess.Popen(
            [ALLOY, "start", "--no-demo", *flags],
            cwd=PROJECT_ROOT,
            env=self.env,
            stdout=log.open("w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            found = READY_LINE.search(log.read_text())
            if found:
                self.url, self.key = found.groups()
                if self.key.startswith("$(cat"):  # a restart: the key was printed at the first start only
                    self.key = Path(self.key[len("$(cat ") : -1]).read_text().strip()
                return
            assert self.process.poll() is None, f"alloy start exited {self.process.returncode}:\n{self.log_tail()}"
            time.sleep(1.0)
        raise AssertionError(f"alloy start not READY after {READY_TIMEOUT_S}s:\n{self.log_tail()}")

    def log_tail(self, chars: int = 4000) -> str:
        return self.logs[-1].read_text()[-chars:] if self.logs else ""

    def cli(self, *args: str, timeout_s: float = 420) -> subprocess.CompletedProcess:
        return subprocess.run(
            [ALLOY, *args], cwd=PROJECT_ROOT, env=self.env, capture_output=True, text=True, timeout=timeout_s
        )

    def submit_merge(self, output: str) -> str:
        response = httpx.post(
            f"{self.url}/merge/execute",
            headers={"Authorization": f"Bearer {self.key}"},
            json={
                "models": ["big-a", "big-b"],
                "strategy": "slerp",
                "parameters": {"t": 0.5},
                "output_model_id": output,
            },
            timeout=60,
        )
        assert response.status_code == 202, response.text
        return response.json()["job_id"]

    def wait_job(self, job_id: str, states: set[JobState], timeout_s: float = 300, poll_s: float = 0.02) -> JobState:
        jobs = JobStore(self.db)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            state = jobs.get(job_id).state
            if state in states:
                return state
            time.sleep(poll_s)
        raise AssertionError(f"job {job_id} not in {states} after {timeout_s}s: {jobs.get(job_id).state}")

    def wait_exit(self, timeout_s: float = 120) -> int:
        return self.process.wait(timeout=timeout_s)

    def consistency(self):
        return Recovery(
            self.db, self.store, models=self.models, scratch_dirs=[(self.data_dir / "work" / "merges").resolve()]
        ).check()


def _kill_tree(root_pid: int) -> int:
    """SIGKILL a process and every descendant (the whole Ray cluster it started), as an OOM killer or a power
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
    _, alive = psutil.wait_procs(victims, timeout=20)
    assert not alive, f"survivors: {alive}"
    return len(victims)


@pytest.fixture(scope="module")
def operator(tmp_path_factory, tiny_model_factory):
    from alloy.control.local_run import _ray_temp_dir

    root = tmp_path_factory.mktemp("lifecycle")
    data_dir = root / "var"
    data_dir.mkdir()
    base = tiny_model_factory("llama", seed=10, **MODEL_SHAPE)
    tune = tiny_model_factory("llama", seed=11, base=base, **MODEL_SHAPE)
    settings = {
        "data_dir": str(data_dir),
        "model_roots": [str(base.parent)],
        "database": {"url": f"sqlite:///{data_dir / 'alloy.db'}"},
        "artifacts": {"uri": str(root / "art")},
    }
    config_file = root / "alloy.yaml"
    config_file.write_text(yaml.safe_dump(settings))
    db = Database(settings["database"]["url"])
    db.upgrade()
    store = ArtifactStore(settings["artifacts"]["uri"])
    models = ModelRegistry(db, store, model_roots=[base.parent], data_dir=data_dir)
    models.register("big-a", base)
    models.register("big-b", tune)
    operator = Operator(root=root, config_file=config_file, data_dir=data_dir, db=db, models=models, store=store)
    yield operator
    if operator.process is not None and operator.process.poll() is None:
        _kill_tree(operator.process.pid)  # a failed test must not leave a cluster behind
    db.close()
    shutil.rmtree(_ray_temp_dir(data_dir), ignore_errors=True)


def test_kill_9_of_the_whole_cluster_during_a_merge_then_restart_completes_it(operator):
    operator.start()
    job_id = operator.submit_merge("killed-merged")
    seen = operator.wait_job(job_id, {JobState.RUNNING, JobState.COMPLETED, JobState.FAILED})
    killed = _kill_tree(operator.process.pid)
    assert seen is JobState.RUNNING, "the merge finished before the kill: make MODEL_SHAPE bigger"
    assert killed > 5  # alloy start, ray start, GCS, raylet, dashboard, workers: the whole cluster
    jobs = JobStore(operator.db)
    assert jobs.get(job_id).state is JobState.RUNNING  # nobody could record anything
    assert not operator.models.exists("killed-merged")

    status = operator.cli("status", "--json", timeout_s=60)
    assert json.loads(status.stdout)["state"] == "READY"  # as the dead cluster left it ...
    assert json.loads(status.stdout)["pid"] is None and json.loads(status.stdout)["alive"] is False
    assert status.returncode == 1 and "the cluster is dead" in status.stderr  # ... but dead, and says so

    operator.start()
    start = ClusterStateStore(operator.db).get().last_start
    assert [(s.name, s.status) for s in start.steps] == [
        ("load configuration", "ok"),
        ("validate dependencies", "ok"),
        ("connect registries", "ok"),
        ("consistency check", "ok"),
        ("initialise worker pools", "ok"),
        ("health-check endpoints", "ok"),
        ("mark READY", "ok"),
        ("replay interrupted jobs", "ok"),
    ]
    assert start.steps[3].detail.startswith("1 interrupted jobs")
    # The requeued job is dispatched once: by the replay step, or, when the machine is slow enough that an engine's
    # lost-job sweeper runs between the pools' start and the replay step (seen under load), by that sweeper; the
    # replay step then finds it claimed and leaves it. Either way it must complete as attempt 1 (below).
    assert start.steps[-1].detail.startswith(("1 jobs replayed", "0 jobs replayed, 0 failed"))

    assert operator.wait_job(job_id, {JobState.COMPLETED, JobState.FAILED}, poll_s=0.5) is JobState.COMPLETED
    job = jobs.get(job_id)
    assert job.attempts == 1 and job.result["model_id"] == "killed-merged"
    events = [e.event for e in jobs.events(job_id)]
    assert "interrupted" in events and events.index("replayed") > events.index("interrupted")
    assert operator.models.get("killed-merged").lineage["job_id"] == job_id
    report = operator.consistency()  # nothing orphaned, broken, staged or left in the merge scratch
    assert report.consistent, report.summary()
    print("restart steps (s):", {s.name: s.duration_s for s in start.steps})


def test_graceful_stop_waits_for_the_active_merge_and_finishes_it(operator):
    assert operator.process is not None and operator.process.poll() is None, "needs the cluster of the test above"
    job_ids = [operator.submit_merge(f"drained-{n}") for n in range(QUEUED_MERGES)]
    stopped = operator.cli("stop")  # at once: merges are active (queued or running) when the stop begins

    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    assert operator.wait_exit() == 0
    assert "cluster: STOPPED" in stopped.stdout
    cluster = ClusterStateStore(operator.db).get()
    assert cluster.state is ClusterState.STOPPED
    last_stop = cluster.last_stop
    assert last_stop.mode == "graceful" and last_stop.ok, last_stop
    assert [s.name for s in last_stop.steps] == [
        "reject submissions",
        "wait for active merges and evaluations",
        "flush tracker",
        "close registries",
        "terminate worker pools",
        "mark STOPPED",
    ]
    waited = int(last_stop.steps[1].detail.split()[0])
    assert waited >= 1, f"no merge was active when the stop began: {last_stop.steps[1].detail}"
    jobs = JobStore(operator.db)
    for n, job_id in enumerate(job_ids):  # every one finished by the stop's wait, none interrupted
        job = jobs.get(job_id)
        assert job.state is JobState.COMPLETED and job.attempts == 0, (job.state, job.error)
        assert operator.models.get(f"drained-{n}").lineage["job_id"] == job_id
    assert cluster.pools.get("MergeEngine", 0) >= 1  # saved for the next warm start

    status = operator.cli("status", timeout_s=60)
    assert status.returncode == 3 and "cluster: STOPPED" in status.stdout
    assert "terminate worker pools" in status.stdout
    print("graceful stop steps (s):", {s.name: s.duration_s for s in last_stop.steps})


def test_warm_start_then_stop_with_a_1s_timeout_forces_and_the_job_is_replayable(operator):
    operator.start("--warm", "--skip-dependency-checks")
    start = ClusterStateStore(operator.db).get().last_start
    assert start.mode == "warm" and start.ok
    assert [(s.name, s.status) for s in start.steps][:4] == [
        ("load configuration", "ok"),
        ("validate dependencies", "skipped"),
        ("consistency check", "ok"),
        ("restore worker pools", "ok"),
    ]
    assert "abbreviated health checks" in [s.name for s in start.steps]

    job_ids = [operator.submit_merge(f"forced-{n}") for n in range(QUEUED_MERGES)]
    stopped = operator.cli("stop", "--timeout", "1")

    assert stopped.returncode == 2, stopped.stdout + stopped.stderr  # escalated to forced
    assert operator.wait_exit() == 2
    last_stop = ClusterStateStore(operator.db).get().last_stop
    assert last_stop.mode == "graceful->forced" and not last_stop.ok
    assert [s.name for s in last_stop.steps][:3] == [
        "reject submissions",
        "wait for active merges and evaluations",
        "cancel active tasks",
    ]
    assert ClusterStateStore(operator.db).state() is ClusterState.STOPPED
    jobs = JobStore(operator.db)
    interrupted = [job_id for job_id in job_ids if jobs.get(job_id).state is not JobState.COMPLETED]
    assert interrupted, "every merge finished within the 1 s timeout: queue more (QUEUED_MERGES)"
    outputs = {job_id: f"forced-{n}" for n, job_id in enumerate(job_ids) if job_id in interrupted}
    assert all(jobs.get(job_id).state is JobState.CREATED for job_id in outputs)  # back in the queue
    # The merges that had started are recorded as interrupted (a queued one that never started has no run to
    # interrupt and simply stays CREATED).
    assert any(jobs.events(job_id)[-1].event == "interrupted" for job_id in interrupted)
    report = operator.consistency()
    assert sorted(j.id for j in report.interrupted_jobs) == sorted(interrupted)  # what the next start replays
    # No partial model: nothing broken, no record without its files. The forced stop kills merges wherever they
    # are: staging leftovers and partial outputs may remain; so may an interrupted job's complete output, published
    # but not yet recorded (an orphan folder), or recorded by that very job before its COMPLETED (lineage names it).
    # The start's repair removes all of them before it replays the jobs.
    assert not report.broken_records
    assert all(
        not o.half_published and o.prefix.removeprefix("models/") in outputs.values() for o in report.orphan_artifacts
    ), report.orphan_artifacts
    for job in report.interrupted_jobs:
        if operator.models.exists(outputs[job.id]):
            assert job.output_registered_by_job and operator.models.get(outputs[job.id]).lineage["job_id"] == job.id
    Recovery(operator.db, operator.store, models=operator.models).repair(report)
    assert not any(operator.models.exists(output) for output in outputs.values())
    assert not operator.consistency().orphan_artifacts
    print("forced stop steps (s):", {s.name: s.duration_s for s in last_stop.steps})
