"""The merge job runner without Ray: real SQLite, a real local artifact store, real tiny models."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from alloy.errors import AlloyError, ErrorCode
from alloy.jobs.liveness import OrphanSweeper, sweep_orphans
from alloy.jobs.merge_admission import create_merge_job, validate_merge_request
from alloy.jobs.merge_request import MergeRequest
from alloy.jobs.merge_runner import MergeJobRunner
from alloy.jobs.records import JobKind, JobState
from alloy.jobs.store import JobStore
from alloy.registry.models import ModelRegistry
from alloy.storage.artifacts import ArtifactStore
from alloy.storage.db import Database


@pytest.fixture()
def world(tmp_path, tiny_family, tiny_model_factory):
    db = Database(f"sqlite:///{tmp_path / 'alloy.db'}")
    db.upgrade()
    store = ArtifactStore(str(tmp_path / "artifacts"))
    roots = [Path(tiny_family[0]).parent]
    registry = ModelRegistry(db, store, model_roots=roots, data_dir=tmp_path)
    base, tunes = tiny_family
    registry.register("base", base)
    for index, tune in enumerate(tunes):
        registry.register(f"tune{index + 1}", tune)
    registry.register("gpt", tiny_model_factory("gpt2", seed=5))
    jobs = JobStore(db)
    runner = MergeJobRunner(jobs, registry, tmp_path / "work", heartbeat_s=0.2, cache_bytes=1 << 30)
    yield {"db": db, "store": store, "registry": registry, "jobs": jobs, "runner": runner, "tmp": tmp_path}
    db.close()


def leftovers(world) -> list[Path]:
    work = world["tmp"] / "work"
    return list(work.rglob("*")) if work.exists() else []


def ties_request(output: str, **extra) -> MergeRequest:
    return MergeRequest(
        models=["tune1", "tune2"],
        strategy="ties",
        base_model="base",
        parameters={"density": 0.5},
        output_model_id=output,
        **extra,
    )


def submit(world, request: MergeRequest) -> str:
    return create_merge_job(world["jobs"], request).id


def test_merge_job_runs_to_completed_and_registers_a_loadable_model(world):
    job_id = submit(world, ties_request("merged"))
    record = world["runner"].run(job_id)

    assert record.state is JobState.COMPLETED, record.error
    assert record.result["model_id"] == "merged"
    assert record.progress["percent"] == 100.0
    assert record.progress["tensors_done"] == record.progress["tensors_total"] > 0
    assert [e.to_state for e in world["jobs"].events(job_id)] == [
        JobState.CREATED,
        JobState.PREPARING,
        JobState.RUNNING,
        JobState.COMPLETED,
    ]
    model = world["registry"].get("merged")
    assert model.lineage["job_id"] == job_id

    import transformers

    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(world["registry"].local_dir("merged")))
    assert sum(p.numel() for p in loaded.parameters()) == model.parameter_count
    assert leftovers(world) == []  # the private work folder is cleaned up


def test_a_failed_job_leaves_nothing_registered_and_no_artifact(world):
    job_id = submit(world, ties_request("never"))
    world["registry"].delete("tune2")  # the registry changed between validation and execution

    record = world["runner"].run(job_id)

    assert record.state is JobState.FAILED
    assert record.error.code == "MODEL_NOT_FOUND"
    assert not world["registry"].exists("never")
    assert world["store"].list("models/never") == []
    assert leftovers(world) == []


def test_a_cancelled_merge_is_recorded_as_interrupted_and_replays(world):
    job_id = submit(world, ties_request("replayed"))
    cancel = threading.Event()
    cancel.set()

    record = world["runner"].run(job_id, cancel)

    assert record.state is JobState.CREATED and record.attempts == 1
    assert "interrupted" in [e.event for e in world["jobs"].events(job_id)]
    assert not world["registry"].exists("replayed")

    record = world["runner"].run(job_id)
    assert record.state is JobState.COMPLETED
    assert "replayed" in [e.event for e in world["jobs"].events(job_id)]


def test_a_second_run_of_the_same_job_is_a_no_op(world):
    job_id = submit(world, ties_request("once"))
    assert world["runner"].run(job_id).state is JobState.COMPLETED
    again = world["runner"].run(job_id)
    assert again.state is JobState.COMPLETED and again.attempts == 0


def test_sweep_requeues_a_job_whose_owner_stopped_beating(world):
    job_id = submit(world, ties_request("orphan"))
    world["jobs"].transition(job_id, JobState.PREPARING)
    world["jobs"].transition(job_id, JobState.RUNNING)

    merge = JobKind.MERGE
    assert sweep_orphans(world["jobs"], kind=merge, stale_after_s=3600) == []  # fresh: still owned
    assert sweep_orphans(world["jobs"], kind=merge, stale_after_s=0, running_here={job_id}) == []  # owned by us
    assert sweep_orphans(world["jobs"], kind=JobKind.EVOLUTION, stale_after_s=0) == []  # another engine's kind
    assert sweep_orphans(world["jobs"], kind=merge, stale_after_s=0) == [job_id]

    events = world["jobs"].events(job_id)
    assert events[-1].event == "interrupted" and "owner lost" in events[-1].reason
    assert world["runner"].run(job_id).state is JobState.COMPLETED


def test_the_sweeper_thread_dispatches_lost_jobs_and_leaves_its_own(world):
    lost, own = submit(world, ties_request("lost")), submit(world, ties_request("own"))
    for job_id in (lost, own):
        world["jobs"].transition(job_id, JobState.PREPARING)
        world["jobs"].transition(job_id, JobState.RUNNING)
    dispatched = []
    sweeper = OrphanSweeper(
        world["jobs"],
        JobKind.MERGE,
        stale_after_s=0,
        running_here=lambda: {own},
        dispatch=dispatched.append,
        interval_s=3600,
        first_after_s=0.01,
    ).start()
    try:
        deadline = threading.Event()
        for _ in range(200):
            if dispatched:
                break
            deadline.wait(0.05)
    finally:
        sweeper.stop()
    assert dispatched == [lost]
    assert world["jobs"].get(lost).state is JobState.CREATED and world["jobs"].get(own).state is JobState.RUNNING


def test_model_cache_counts_hits_across_jobs_and_clears(world):
    runner = world["runner"]
    runner.run(submit(world, ties_request("first")))
    first = runner.cache.stats()
    assert first.misses == 3 and first.hits == 0
    runner.run(submit(world, ties_request("second")))
    assert runner.cache.stats().hits == 3
    runner.cache.clear()
    assert runner.cache.stats().hit_rate == 0.0


@pytest.mark.parametrize(
    "request_fields, code",
    [
        ({"strategy": "blend"}, ErrorCode.INVALID_STRATEGY),
        ({"parameters": {"density": 7}}, ErrorCode.VALIDATION_FAILED),
        ({"models": ["tune1", "ghost"]}, ErrorCode.MODEL_NOT_FOUND),
        ({"models": ["tune1", "gpt"]}, ErrorCode.INCOMPATIBLE_MODELS),
        ({"output_model_id": "tune3"}, ErrorCode.ALREADY_EXISTS),
    ],
)
def test_synchronous_validation_errors(world, request_fields, code):
    fields = {
        "models": ["tune1", "tune2"],
        "strategy": "ties",
        "base_model": "base",
        "parameters": {"density": 0.5},
        "output_model_id": "fresh",
        **request_fields,
    }
    with pytest.raises(AlloyError) as caught:
        validate_merge_request(MergeRequest(**fields), models=world["registry"], jobs=world["jobs"])
    assert caught.value.code is code


def test_an_output_id_claimed_by_a_running_job_is_refused(world):
    submit(world, ties_request("claimed"))
    with pytest.raises(AlloyError) as caught:
        validate_merge_request(ties_request("claimed"), models=world["registry"], jobs=world["jobs"])
    assert caught.value.code is ErrorCode.ALREADY_EXISTS


def test_a_job_requeued_while_its_runner_goes_on_stays_requeued_and_replays(world):
    """A forced stop (or a sweeper) requeues the job while the runner is still evaluating: the runner's next
    move gets CONFLICT. It must give the job up (unregistering its own output), not fail it: fail() is legal
    from CREATED and would end the requeued job FAILED."""
    request = ties_request("moved", evaluate={"datasets": ["any"]})
    job_id = submit(world, request)

    def evaluate_while_requeued(_out_dir, _request):
        world["jobs"].requeue(job_id, "interrupted: forced shutdown")
        return {"score": 1.0}

    runner = MergeJobRunner(
        world["jobs"], world["registry"], world["tmp"] / "work", heartbeat_s=0.2, evaluate=evaluate_while_requeued
    )
    record = runner.run(job_id)

    assert record.state is JobState.CREATED and record.attempts == 1, (record.state, record.error)
    assert record.error is None
    assert world["jobs"].events(job_id)[-1].event == "interrupted"
    assert not world["registry"].exists("moved")  # the run's registered output is gone again
    assert leftovers(world) == []

    replayed = world["runner"].run(job_id)
    assert replayed.state is JobState.COMPLETED and replayed.result["model_id"] == "moved"


def test_the_scratch_folder_is_gone_by_the_time_the_job_reads_completed(world):
    """A client (or the recovery check) that sees COMPLETED must find nothing left behind."""
    seen_at_completion: list[list[Path]] = []

    class ObservingJobStore(JobStore):
        def complete(self, job_id, result, **kwargs):
            seen_at_completion.append(leftovers(world))
            return super().complete(job_id, result, **kwargs)

    runner = MergeJobRunner(ObservingJobStore(world["db"]), world["registry"], world["tmp"] / "work", heartbeat_s=0.2)
    record = runner.run(submit(world, ties_request("tidy")))

    assert record.state is JobState.COMPLETED
    assert seen_at_completion == [[]]
