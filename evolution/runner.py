"""Run one search on the connected Ray cluster: a fresh ``Tuner`` or, when the run's folder holds a Tune
experiment (a forced shutdown interrupted it), ``Tuner.restore`` continuing from the last checkpoints.

The run's folder is ``<storage_path>/<run name>`` (the engine uses ``<data_dir>/evolutions/<job id>``).
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from evolution.config import SearchSettings
from evolution.genome import GenomeSpace
from evolution.parents import ParentArrays
from evolution.racing import racing_of
from evolution.sampled import OPTUNA_KINDS
from evolution.scoring import ScorerSpec
from evolution.search import EvolutionStopper, build_tune_config, is_cancelled
from evolution.tracking import Candidate, CandidateCallback, CandidateSink, register_sink
from evolution.trainable import TrialSetup, evolution_trainable

log = logging.getLogger(__name__)


class SearchOutcome(BaseModel):
    candidates: list[Candidate]
    resumed: bool
    cancelled: bool
    errored_trials: list[str]
    wall_s: float
    experiment_path: str


def _trainable(parents: ParentArrays, data: Any, setup: TrialSetup, settings: SearchSettings):
    # lazy: Ray Tune loads only in a process that runs a search
    from ray import tune

    # with_parameters puts parents and data in the object store once; every trial on a node maps the same bytes.
    trainable = tune.with_parameters(evolution_trainable, parents=parents, data=data, setup=setup)
    return tune.with_resources(trainable, {"cpu": settings.cpus_per_trial, "gpu": settings.gpus_per_trial})


# Tune snapshots the experiment (trial states and their latest checkpoints) at most every 10 s by default; a
# forced shutdown then loses up to that much search. Snapshots of an evolution are a few KB, so take them often.
EXPERIMENT_SNAPSHOT_PERIOD_S = "2"


def experiment_path_of(storage_path: str | Path, run_name: str) -> Path:
    return Path(storage_path).resolve() / run_name


def can_resume(storage_path: str | Path, run_name: str) -> bool:
    """True when an interrupted run left a Tune experiment that ``Tuner.restore`` can continue."""
    # lazy: Ray Tune loads only in a process that runs a search
    from ray import tune

    return tune.Tuner.can_restore(str(experiment_path_of(storage_path, run_name)))


def run_search(
    *,
    run_name: str,
    storage_path: str | Path,
    space: GenomeSpace,
    settings: SearchSettings,
    parents: ParentArrays,
    data: Any,
    scorer: ScorerSpec,
    device: str = "cpu",
    sink: CandidateSink | None = None,
    verbose: int = 0,
) -> SearchOutcome:
    """Run (or resume) the search; every candidate reported in this process reaches ``sink`` and the outcome.
    (Tune's per-trial result files are not a complete record across PBT restarts; the callback is.)"""
    # lazy: Ray Tune loads only in a process that runs a search
    from ray import tune

    storage_path = Path(storage_path).resolve()
    experiment_path = experiment_path_of(storage_path, run_name)
    os.environ.setdefault("TUNE_GLOBAL_CHECKPOINT_S", EXPERIMENT_SNAPSHOT_PERIOD_S)  # read by each Tuner.fit
    setup = TrialSetup(
        space=space,
        scorer=scorer,
        generations=settings.generations,
        # fidelity asha scores its rungs instead of a rotating batch
        dev_batch_size=None if settings.fidelity == "asha" else settings.dev_batch_size,
        batch_seed=settings.seed,
        device=device,
        ordinal_generations=settings.population if settings.kind in OPTUNA_KINDS else None,
        incarnation=uuid.uuid4().hex,
        racing=racing_of(settings),
    )
    trainable = _trainable(parents, data, setup, settings)
    started = time.perf_counter()
    resumed = can_resume(storage_path, run_name)
    if resumed:
        log.info("resuming evolution %s from %s", run_name, experiment_path)
        tuner = tune.Tuner.restore(
            str(experiment_path), trainable=trainable, resume_unfinished=True, resume_errored=True
        )
    else:
        tune_config, param_space = build_tune_config(space, settings, objectives=len(scorer.dataset_ids))
        run_config = tune.RunConfig(
            name=run_name,
            storage_path=str(storage_path),
            stop=EvolutionStopper(run_name, settings.generations, settings.target_fitness),
            callbacks=[CandidateCallback(run_name)],
            # Keep every checkpoint: each holds one genome (bytes), and a capped count lets Tune delete a PBT
            # donor's checkpoint before the recipient restores from it (the donor-checkpoint pitfall).
            checkpoint_config=tune.CheckpointConfig(num_to_keep=None),
            failure_config=tune.FailureConfig(max_failures=1),
            verbose=verbose,
        )
        tuner = tune.Tuner(trainable, param_space=param_space, tune_config=tune_config, run_config=run_config)
    collected = _CollectingSink(sink)
    register_sink(run_name, collected)
    try:
        grid = tuner.fit()
    finally:
        register_sink(run_name, None)
    cancelled = is_cancelled(run_name)
    errored = [str(grid[i].path) for i in range(len(grid)) if grid[i].error is not None]
    candidates = sorted(collected.candidates, key=lambda c: (c.generation, c.candidate_id))
    return SearchOutcome(
        candidates=candidates,
        resumed=resumed,
        cancelled=cancelled,
        errored_trials=errored,
        wall_s=time.perf_counter() - started,
        experiment_path=str(experiment_path),
    )


class _CollectingSink:
    def __init__(self, downstream: CandidateSink | None):
        self.downstream = downstream
        self.candidates: list[Candidate] = []

    def on_candidate(self, candidate: Candidate) -> None:
        self.candidates.append(candidate)
        if self.downstream is not None:
            self.downstream.on_candidate(candidate)
