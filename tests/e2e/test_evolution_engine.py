"""The evolution engine in this process, on the storage of the session service (same database, artifact folder
and built ``tiny`` preset as ``alloy_service``, so the preset is built once per session).

The resume test kills the process driving a real Tune search mid-way (SIGKILL: no cleanup, the job stays
RUNNING, the Tune experiment folder stays on disk), requeues the job as the recovery sweep does, runs it again
and checks that it continued with ``Tuner.restore`` instead of starting over.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.e2e.test_evolution_http import PROJECT_ROOT, TINY_CONFIG, _latest_snapshot_mtime, tiny_request

pytestmark = pytest.mark.ray

FRESH_CANDIDATES = 3 * 3  # population x generations of configs/evolve-tiny.yaml


def service_env(alloy_service) -> dict[str, str]:
    """``ALLOY_*`` settings that point a driver process at the session service's storage."""
    return {"ALLOY_DATA_DIR": str(alloy_service.data_dir), "ALLOY_DATABASE__URL": alloy_service.database_url}


@pytest.fixture(scope="module")
def engine(alloy_service):
    from alloy.config import load_settings
    from evolution.engine import EvolutionService

    settings = load_settings(data_dir=alloy_service.data_dir, database={"url": alloy_service.database_url})
    return EvolutionService.from_settings(settings)


def test_cancel_before_start_fails_the_job_as_cancelled(engine):
    job = engine.jobs.create("evolution", tiny_request("cancelled before it starts"))
    engine.cancel(job.id)
    record = engine.jobs.get(job.id)
    assert record.state.value == "FAILED" and record.error.code == "CANCELLED"
    assert engine.run_job(job.id) == {}


def test_a_running_evolution_is_never_claimed_twice(alloy_service, engine, ray_cluster, monkeypatch, capsys):
    """A second dispatch of a job that a live owner runs (fresh heartbeat) does nothing: neither the engine nor
    ``python -m evolution.run --job-id`` takes it over; the batch driver says why and exits 2."""
    from alloy.jobs.records import JobState
    from evolution.run import main as batch_main

    job = engine.jobs.create("evolution", tiny_request("owned elsewhere"))
    engine.jobs.transition(job.id, JobState.PREPARING)
    engine.jobs.transition(job.id, JobState.RUNNING, progress={"heartbeat_at": "now"})

    assert engine.run_job(job.id) == {}
    for name, value in service_env(alloy_service).items():
        monkeypatch.setenv(name, value)
    assert batch_main([str(TINY_CONFIG), "--job-id", job.id]) == 2
    assert "its owner wrote" in capsys.readouterr().err
    after = engine.jobs.get(job.id)
    assert after.state is JobState.RUNNING and after.attempts == 0
    assert [e.event for e in engine.jobs.events(job.id)][-1] != "interrupted"
    engine.jobs.fail(job.id, "INTERNAL_ERROR", "test cleanup")  # no sweeper may pick it up later


def _wait_for(predicate, timeout_s: float, what: str, process: subprocess.Popen | None = None):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if process is not None and process.poll() is not None:
            raise AssertionError(f"the driver exited ({process.returncode}) before {what}")
        time.sleep(0.3)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


RESUME_GENERATIONS = 8  # a longer tiny run: room to kill it after generation 2 and before the end
RESUME_CANDIDATES = 3 * RESUME_GENERATIONS


def test_a_killed_evolution_resumes_from_its_tune_checkpoint(alloy_service, engine, ray_cluster, tmp_path):
    request = tiny_request("killed, then resumed")
    request["search"]["generations"] = RESUME_GENERATIONS
    # A hung restore ends as a failed assertion, not a CI timeout (with room for a loaded CI machine).
    request["search"]["time_budget_s"] = 300
    job = engine.jobs.create("evolution", request, owner="resume-test")
    experiment = alloy_service.data_dir / "evolutions" / job.id
    log_path = tmp_path / "driver.log"
    # The batch driver joined to the session cluster (RAY_ADDRESS + token env), snapshotting Tune's experiment
    # every 0.5 s instead of evolution.runner's 2 s, so that the kill lands after a snapshot with checkpoints.
    env = {**os.environ, **ray_cluster.env, **service_env(alloy_service), "TUNE_GLOBAL_CHECKPOINT_S": "0.5"}
    with log_path.open("wb") as log:
        driver = subprocess.Popen(
            [sys.executable, "-m", "evolution.run", str(TINY_CONFIG), "--job-id", job.id],
            cwd=PROJECT_ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        # Mid-search: every trial has finished generation 2 (reported with its checkpoint), and Tune has written
        # an experiment snapshot since then. Restored trials then start at generation >= 2, where a fresh PBT
        # scheduler used to set its synchronous barrier *at* their generation and hang (see GenomePBT).
        _wait_for(lambda: engine.jobs.get(job.id).progress.get("trials", 0) >= 6, 240, "generation 2", driver)
        generation_2_done = time.time()
        _wait_for(
            lambda: _latest_snapshot_mtime(experiment) > generation_2_done + 0.2,
            60,
            "a Tune snapshot after generation 2",
            driver,
        )
    except AssertionError:
        driver.kill()
        raise AssertionError(log_path.read_text(errors="replace")[-3000:]) from None
    os.killpg(driver.pid, signal.SIGKILL)  # a forced shutdown: no finally blocks, no Tune teardown
    driver.wait(timeout=30)

    interrupted = engine.jobs.get(job.id)
    assert interrupted.state.value == "RUNNING", interrupted.state
    done_before = interrupted.progress["trials"]
    assert 6 <= done_before < RESUME_CANDIDATES, "the search ended before the kill: nothing to resume"
    # Recorded as they arrived: a candidate is written before the progress counts it (evolution.tracking.RecordingSink),
    # so a SIGKILL between the two writes leaves at most one candidate the progress has not counted yet.
    assert done_before <= len(engine.trials(job.id)) <= done_before + 1
    engine.jobs.requeue(job.id, "driver killed mid-search (test)")

    result = engine.run_job(job.id)

    record = engine.jobs.get(job.id)
    assert record.state.value == "COMPLETED", record.error
    search = result["search"]
    assert search["resumed"] is True and record.progress.get("resumed_from_checkpoint") is True
    # continued, not restarted: fewer candidates evaluated than a fresh run needs, and every candidate exists
    assert search["evaluated_this_run"] < RESUME_CANDIDATES, search
    # Every candidate exactly once: a restored trial re-runs the generation of its own checkpoint, which Tune may
    # have filled with a generation the killed driver never recorded (evolution.trainable._resume_state), and no
    # PBT round runs among restored trials at different generations (evolution.search.GenomePBT).
    assert search["candidates"] == RESUME_CANDIDATES, search
    assert record.progress["generation"] == RESUME_GENERATIONS, search
    trials = engine.trials(job.id)
    assert len(trials) == search["candidates"]
    assert sorted({t["generation"] for t in trials}) == list(range(1, RESUME_GENERATIONS + 1))
    events = [(e.event, e.reason) for e in engine.jobs.events(job.id)]
    assert ("interrupted", "driver killed mid-search (test)") in events and ("replayed", None) in events, events
