"""Run one search on the connected Ray cluster: a fresh ``Tuner`` or, when the run's folder holds a Tune
experiment (a forced shutdown interrupted it), ``Tuner.restore`` continuing from the last checkpoints.

The run's folder is ``<storage_path>/<run name>`` (the engine uses ``<data_dir>/evolutions/<job id>``).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from evolution.config import SearchSettings
from evolution.genome import GenomeSpace
from evolution.parents import ParentArrays
from evolution.scoring import ScorerSpec
from evolution.search import EvolutionStopper, build_tune_config, is_cancelled
from evolution.tracking import Candidate, CandidateCallback
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
    from ray import tune

    # with_parameters puts parents and data in the object store once; every trial on a node maps the same bytes.
    trainable = tune.with_parameters(evolution_trainable, parents=parents, data=data, setup=setup)
    return tune.with_resources(trainable, {"cpu": settings.cpus_per_trial, "gpu": settings.gpus_per_trial})


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
    verbose: int = 0,
) -> SearchOutcome:
    from ray import tune

    storage_path = Path(storage_path).resolve()
    experiment_path = storage_path / run_name
    setup = TrialSetup(
        space=space, scorer=scorer, generations=settings.generations, dev_batch_size=settings.dev_batch_size,
        batch_seed=settings.seed, device=device,
        ordinal_generations=settings.population if settings.kind == "cmaes" else None,
    )
    trainable = _trainable(parents, data, setup, settings)
    started = time.perf_counter()
    resumed = tune.Tuner.can_restore(str(experiment_path))
    if resumed:
        log.info("resuming evolution %s from %s", run_name, experiment_path)
        tuner = tune.Tuner.restore(str(experiment_path), trainable=trainable, resume_unfinished=True,
                                   resume_errored=True)
    else:
        tune_config, param_space = build_tune_config(space, settings)
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
    grid = tuner.fit()
    cancelled = is_cancelled(run_name)
    candidates, errored = collect_candidates(grid)
    return SearchOutcome(candidates=candidates, resumed=resumed, cancelled=cancelled, errored_trials=errored,
                         wall_s=time.perf_counter() - started, experiment_path=str(experiment_path))


def collect_candidates(grid) -> tuple[list[Candidate], list[str]]:
    """Every candidate of every trial, from Tune's own per-trial result logs (complete after a restore too)."""
    candidates: dict[str, Candidate] = {}
    errored: list[str] = []
    for result in grid:
        trial_id = result.metrics.get("trial_id") if result.metrics else None
        if result.error is not None:
            errored.append(str(trial_id or result.path))
        frame = result.metrics_dataframe
        if frame is None or "candidate_id" not in frame.columns:
            continue
        for row in frame.to_dict("records"):
            if not isinstance(row.get("candidate_id"), str):
                continue
            candidate = Candidate.from_result(str(row.get("trial_id") or trial_id), row)
            candidates[candidate.candidate_id] = candidate
    return sorted(candidates.values(), key=lambda c: (c.generation, c.candidate_id)), errored
