"""A real ``tiny`` evolution on the session Ray cluster: PBT over task-arithmetic genomes, in-memory candidates,
tracker records with lineage, the winner merged, registered and scored on test, the fitness plot stored."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.ray

TINY_REQUEST = {
    "name": "tiny evolution (test)",
    "preset": "tiny",
    "strategy": "task_arithmetic",
    "genome": {"per_model": {"weight": [0.0, 1.5, 1.0]}, "global_parameters": {"lambda": [0.1, 1.5, 0.5]}},
    "search": {"kind": "pbt", "population": 4, "generations": 3, "dev_batch_size": 16, "finalists": 2,
               "cpus_per_trial": 0.5, "seed": 0},
}


@pytest.fixture(scope="module")
def evo_data_dir(tmp_path_factory) -> Path:
    from alloy.zoo.presets import build_preset

    data_dir = tmp_path_factory.mktemp("evo-data")
    build_preset("tiny", data_dir)
    return data_dir


@pytest.fixture(scope="module")
def service(evo_data_dir, ray_cluster):
    from alloy.config import load_settings
    from evolution.engine import EvolutionService

    settings = load_settings(data_dir=evo_data_dir, model_roots=[evo_data_dir])
    service = EvolutionService.from_settings(settings)
    service.db.upgrade()
    return service


def test_tiny_pbt_evolution_end_to_end(service):
    job = service.jobs.create("evolution", TINY_REQUEST)
    result = service.run_job(job.id)
    record = service.jobs.get(job.id)
    assert record.state.value == "COMPLETED", record.error

    # every candidate is a tracker trial: population x generations, with parents
    trials = service.trials(job.id)
    assert len(trials) == 4 * 3
    assert sorted({t["generation"] for t in trials}) == [1, 2, 3]
    by_id = {t["trial_id"]: t for t in trials}
    later = [t for t in trials if t["generation"] > 1]
    assert all(t["parent_trial"] in by_id for t in later)
    assert all(by_id[t["parent_trial"]]["generation"] == t["generation"] - 1 for t in later)
    assert all("fitness" in t["metrics"] and t["recipe"]["strategy"] == "task_arithmetic" for t in trials)

    # progress as the API shows it
    assert record.progress["generation"] == 3 and record.progress["trials"] == 12
    assert record.progress["best_fitness"] >= record.progress["median_fitness"]

    # the winner: on disk, registered with its lineage, scored on test next to the parents
    model = service.models.get(result["model_id"])
    assert model.lineage["job_id"] == job.id
    assert model.lineage["trial_id"] == result["best_trial"] and result["best_trial"] in by_id
    assert set(model.lineage["parents"]) == {"tiny-enc-ft-letters", "tiny-enc-ft-case"}
    scores = result["test"]["scores"]
    assert {result["model_id"], "tiny-enc-ft-letters", "tiny-enc-ft-case", "tiny-enc-base"} <= set(scores)
    assert all(0.0 <= v <= 1.0 for v in scores.values())
    assert isinstance(result["test"]["beats_every_parent"], bool)

    # the plot is a PNG in the artifact store, linked from the job's result
    plot = result["fitness_plot"]
    assert service.store.read_bytes(plot["key"])[:8] == b"\x89PNG\r\n\x1a\n"

    # the test results are in the tracker too
    logged = {(r.model_id, r.metric) for r in service.tracker.results(result["experiment_id"])}
    assert (result["model_id"], "mean_accuracy") in logged


def test_pbt_exploit_never_needs_a_donor_checkpoint(service):
    """The PBT donor-checkpoint pitfall: with capped checkpoints Tune deletes a donor's checkpoint before the
    exploiting trial restores from it and that trial errors. Here every generation exploits; no trial may error,
    exploited candidates must descend from another trial, and every donor checkpoint must still exist."""
    request = json.loads(json.dumps(TINY_REQUEST))
    request["search"].update(generations=4, quantile_fraction=0.5, finalists=1)
    job = service.jobs.create("evolution", request)
    result = service.run_job(job.id)
    assert service.jobs.get(job.id).state.value == "COMPLETED", service.jobs.get(job.id).error
    assert result["search"]["errored_trials"] == []
    trials = service.trials(job.id)
    assert len(trials) == 4 * 4
    exploited = [t for t in trials if t["parent_trial"]
                 and t["parent_trial"].rsplit("-g", 1)[0] != t["trial_id"].rsplit("-g", 1)[0]]
    assert exploited, "PBT never exploited: the test would not notice the pitfall"
    experiment = service.storage_path / job.id
    assert len(list(experiment.glob("*/checkpoint_*"))) == len(trials)  # nothing was rotated away


def test_cancel_before_start_fails_the_job_as_cancelled(service):
    job = service.jobs.create("evolution", TINY_REQUEST)
    service.cancel(job.id)
    record = service.jobs.get(job.id)
    assert record.state.value == "FAILED" and record.error.code == "CANCELLED"
    assert service.run_job(job.id) == {}
