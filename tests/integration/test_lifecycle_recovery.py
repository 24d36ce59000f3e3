"""Recovery after an interrupted cluster: consistency check, repair and replay, on SQLite and PostgreSQL with
a local and an S3 artifact store, with tiny real models and the real merge job runner."""

from __future__ import annotations

import pytest

from alloy.cluster.recovery import Recovery
from alloy.cluster.state import ClusterStateStore
from alloy.jobs.records import JobKind, JobState
from alloy.jobs.store import JobStore
from alloy.registry.models import ModelRegistry
from alloy.storage.artifacts import PENDING_MARKER, STAGING


@pytest.fixture
def models(database, artifact_store, tiny_family, tmp_path) -> ModelRegistry:
    base, tunes = tiny_family
    registry = ModelRegistry(database, artifact_store, model_roots=[base.parent], data_dir=tmp_path / "var")
    registry.register("tiny-a", tunes[0])
    registry.register("tiny-b", tunes[1])
    return registry


@pytest.fixture
def scratch(tmp_path):
    folder = tmp_path / "var" / "work" / "merges"
    folder.mkdir(parents=True)
    return folder


@pytest.fixture
def recovery(database, artifact_store, models, scratch) -> Recovery:
    return Recovery(database, artifact_store, models=models, state=ClusterStateStore(database), scratch_dirs=[scratch])


def merge_request(output: str = "merged") -> dict:
    return {"models": ["tiny-a", "tiny-b"], "strategy": "slerp", "parameters": {"t": 0.5}, "output_model_id": output}


def start_job(jobs: JobStore, kind: str, request: dict, *states: str) -> str:
    job = jobs.create(kind, request)
    for state in states:
        jobs.transition(job.id, state)
    return job.id


def test_a_clean_registry_is_consistent(recovery):
    report = recovery.check()
    assert report.consistent, report.summary()


def test_non_terminal_jobs_are_requeued_with_an_interrupted_history(recovery, database):
    jobs = JobStore(database)
    running = start_job(jobs, "merge", merge_request(), "PREPARING", "RUNNING")
    evaluating = start_job(jobs, "evaluation", {}, "PREPARING", "RUNNING", "EVALUATING")
    never_started = start_job(jobs, "evolution", {})
    done = start_job(jobs, "merge", merge_request("other"), "PREPARING", "RUNNING")
    jobs.complete(done, {})

    report = recovery.check()
    assert {j.id for j in report.interrupted_jobs} == {running, evaluating, never_started}
    repaired = recovery.repair(report)
    # A CREATED job was not interrupted (a forced stop requeued it already, or it never started): it is replayed
    # without a second attempt counted.
    assert set(repaired.requeued) == {running, evaluating}
    assert jobs.get(never_started).attempts == 0 and jobs.get(never_started).state is JobState.CREATED
    for job_id, was in ((running, "RUNNING"), (evaluating, "EVALUATING")):
        job = jobs.get(job_id)
        assert job.state is JobState.CREATED and job.attempts == 1
        last = jobs.events(job_id)[-1]
        assert last.event == "interrupted" and f"(was {was})" in last.reason
    assert jobs.get(done).state is JobState.COMPLETED  # terminal jobs are left alone
    assert recovery.check().interrupted_jobs[0].state is JobState.CREATED  # still to replay, not yet run


def test_orphan_folders_staging_and_partial_outputs_are_removed(recovery, artifact_store, tiny_family, scratch):
    base, _ = tiny_family
    artifact_store.put_dir("models/ghost", base)  # published, but the registration crashed before its row
    # An S3 folder publish that never finished: files next to the pending marker (written as the store does).
    half = f"{artifact_store.root}/models/org/half"
    artifact_store.fs.makedirs(half, exist_ok=True)
    artifact_store.fs.pipe(f"{half}/{PENDING_MARKER}", b"")
    artifact_store.fs.pipe(f"{half}/model.safetensors", b"partial")
    artifact_store.fs.makedirs(f"{artifact_store.root}/{STAGING}/crashed-writer", exist_ok=True)
    artifact_store.fs.pipe(f"{artifact_store.root}/{STAGING}/crashed-writer/shard", b"x")
    (scratch / "job1-abcd").mkdir()
    (scratch / "job1-abcd" / "model-00001.safetensors").write_bytes(b"half a merge")

    report = recovery.check()
    orphans = {o.prefix: o for o in report.orphan_artifacts}
    assert set(orphans) == {"models/ghost", "models/org/half"}
    assert orphans["models/org/half"].half_published and not orphans["models/ghost"].half_published
    assert report.staging_leftovers == 1 and len(report.partial_outputs) == 1
    assert report.broken_records == []  # tiny-a and tiny-b are intact

    repaired = recovery.repair(report)
    assert sorted(repaired.orphans_deleted) == ["models/ghost", "models/org/half"]
    assert repaired.staging_removed == 1 and not any(scratch.iterdir())
    after = recovery.check()
    assert after.consistent, after.summary()
    assert artifact_store.dir_exists("models/tiny-a")  # registered models untouched


def test_records_whose_artifacts_are_missing_are_marked_broken(recovery, artifact_store, database):
    artifact_store.delete("models/tiny-b/model.safetensors")
    report = recovery.check()
    assert [(b.id, b.reason) for b in report.broken_records] == [
        ("tiny-b", "file 'models/tiny-b/model.safetensors' is missing")
    ]
    repaired = recovery.repair(report)
    assert repaired.broken_marked == ["models/tiny-b"]
    marked = ClusterStateStore(database).get().recovery
    assert marked["broken_records"][0]["id"] == "tiny-b"


def test_replay_dispatches_by_kind_and_fails_what_cannot_run(recovery, database):
    jobs = JobStore(database)
    merge = start_job(jobs, "merge", merge_request(), "PREPARING", "RUNNING")
    evaluation = start_job(jobs, "evaluation", {}, "PREPARING")
    evolution = start_job(jobs, "evolution", {}, "PREPARING", "RUNNING")
    recovery.repair(recovery.check())
    dispatched: list[str] = []

    def broken_dispatch(job):
        raise ConnectionError("EvaluationEngine handle unavailable")

    replay = recovery.replay({JobKind.MERGE: lambda job: dispatched.append(job.id), "evaluation": broken_dispatch})
    assert dispatched == [merge] and replay.dispatched == [merge]
    assert set(replay.failed) == {evaluation, evolution}
    assert "EvaluationEngine handle unavailable" in jobs.get(evaluation).error.message
    assert jobs.get(evolution).error.message == "replay impossible: no evolution engine is deployed"
    assert jobs.get(evolution).state is JobState.FAILED


def test_an_interrupted_merge_reruns_to_completion(recovery, database, models, scratch):
    from alloy.jobs.merge_runner import MergeJobRunner

    jobs = JobStore(database)
    job_id = start_job(jobs, "merge", merge_request(), "PREPARING", "RUNNING")  # ... and the cluster died
    (scratch / f"{job_id}-dead").mkdir()  # its partial output
    recovery.repair(recovery.check())
    runner = MergeJobRunner(jobs, models, scratch)
    recovery.replay({"merge": lambda job: runner.run(job.id)})

    job = jobs.get(job_id)
    assert job.state is JobState.COMPLETED and job.result["model_id"] == "merged" and job.attempts == 1
    assert [e.event for e in jobs.events(job_id)] == [
        "created",
        "transition",
        "transition",
        "interrupted",
        "replayed",
        "transition",
        "transition",
    ]
    assert models.get("merged").lineage["job_id"] == job_id
    assert recovery.check().consistent and not any(scratch.iterdir())


def test_a_merge_that_died_after_registering_reruns_idempotently(recovery, database, models, tiny_family, scratch):
    from alloy.jobs.merge_runner import MergeJobRunner

    jobs = JobStore(database)
    job_id = start_job(jobs, "merge", merge_request(), "PREPARING", "RUNNING")
    # It registered its output and died before COMPLETED.
    models.register("merged", tiny_family[1][2], lineage={"job_id": job_id})
    report = recovery.check()
    assert report.interrupted_jobs[0].output_registered_by_job
    assert recovery.repair(report).unregistered_outputs == ["merged"]
    assert not models.exists("merged")
    runner = MergeJobRunner(jobs, models, scratch)
    recovery.replay({"merge": lambda job: runner.run(job.id)})
    assert jobs.get(job_id).state is JobState.COMPLETED


def test_an_output_taken_by_someone_else_is_not_unregistered(recovery, database, models, tiny_family):
    jobs = JobStore(database)
    start_job(jobs, "merge", merge_request(), "PREPARING", "RUNNING")
    models.register("merged", tiny_family[1][2], lineage={"job_id": "another-job"})
    report = recovery.check()
    assert not report.interrupted_jobs[0].output_registered_by_job
    recovery.repair(report)
    assert models.get("merged").lineage["job_id"] == "another-job"
