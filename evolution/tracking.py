"""From Tune results to Alloy records: every candidate goes to the ExperimentTracker, the job's progress
(generation, best and median fitness, trials) to the JobStore.

The Tune callback itself only carries the run name: Tune pickles callbacks into the experiment folder (for
``Tuner.restore``), and database handles do not pickle. The live sink is registered per process under the run
name, by whoever drives the run (the Serve replica or the ``ray job submit`` driver).
"""

from __future__ import annotations

import json
import logging
import statistics
import threading
from typing import Any, Protocol

from pydantic import BaseModel
from ray.tune import Callback

log = logging.getLogger(__name__)


class Candidate(BaseModel):
    """One evaluated candidate (a trial row in the tracker)."""

    candidate_id: str
    trial_id: str
    generation: int
    fitness: float
    genome: dict[str, float]
    recipe: dict[str, Any]
    metrics: dict[str, Any]
    parent_candidate: str | None = None

    @classmethod
    def from_result(cls, trial_id: str, result: dict[str, Any]) -> Candidate:
        metrics = json.loads(result.get("metrics_json") or "{}")
        metrics.update({key: result[key] for key in ("merge_s", "score_s", "batch_examples") if key in result})
        return cls(
            candidate_id=result["candidate_id"],
            trial_id=trial_id,
            generation=int(result["generation"]),
            fitness=float(result["fitness"]),
            genome=json.loads(result["genome_json"]),
            recipe=json.loads(result["recipe_json"]),
            metrics=metrics,
            parent_candidate=result.get("parent_candidate") or None,
        )


class CandidateSink(Protocol):
    def on_candidate(self, candidate: Candidate) -> None: ...


_SINKS: dict[str, CandidateSink] = {}


def register_sink(run_name: str, sink: CandidateSink | None) -> None:
    if sink is None:
        _SINKS.pop(run_name, None)
    else:
        _SINKS[run_name] = sink


class CandidateCallback(Callback):
    """Forwards each reported candidate to the sink registered for ``run_name`` in this process."""

    def __init__(self, run_name: str):
        self.run_name = run_name

    def on_trial_result(self, iteration, trials, trial, result, **info):
        if "candidate_id" not in result:
            return
        sink = _SINKS.get(self.run_name)
        if sink is None:
            return
        try:
            sink.on_candidate(Candidate.from_result(trial.trial_id, result))
        except Exception:  # a tracker hiccup must not kill the search; the result grid still has every candidate
            log.exception("recording candidate %s failed", result.get("candidate_id"))


class ProgressSummary(BaseModel):
    """The job's progress, computed from the candidates seen so far, keyed by candidate id: a run resumed with
    ``Tuner.restore`` re-evaluates the candidates reported after Tune's last experiment snapshot, and those must
    replace, not add to, what the interrupted run recorded."""

    generations: int
    population: int
    fitness_of: dict[str, tuple[int, float]] = {}  # candidate id -> (generation, fitness)

    def add(self, candidate: Candidate) -> None:
        self.fitness_of[candidate.candidate_id] = (candidate.generation, candidate.fitness)

    @property
    def trials(self) -> int:
        return len(self.fitness_of)

    @property
    def generation(self) -> int:
        return max((generation for generation, _ in self.fitness_of.values()), default=0)

    def progress(self) -> dict[str, Any]:
        best_id = max(self.fitness_of, key=lambda c: self.fitness_of[c][1], default=None)
        latest = [f for g, f in self.fitness_of.values() if g == self.generation]
        return {
            "generation": self.generation,
            "generations": self.generations,
            "population": self.population,
            "trials": self.trials,
            "best_fitness": self.fitness_of[best_id][1] if best_id else None,
            "median_fitness": statistics.median(latest) if latest else None,  # of the latest generation
            "best_candidate": best_id,
            "percent": round(100.0 * min(self.generation, self.generations) / self.generations * 0.9, 1),
        }


class RecordingSink:
    """Records candidates in the tracker and keeps the job's progress current."""

    def __init__(self, *, job_id: str | None, experiment_id: str, tracker, jobs, summary: ProgressSummary):
        self.job_id = job_id
        self.experiment_id = experiment_id
        self.tracker = tracker
        self.jobs = jobs
        self.summary = summary
        self.candidates: list[Candidate] = []
        self._lock = threading.Lock()

    def on_candidate(self, candidate: Candidate) -> None:
        with self._lock:
            self.candidates.append(candidate)
            self.summary.add(candidate)
            if self.tracker is not None:
                self.tracker.record_trial(
                    self.experiment_id,
                    candidate.candidate_id,
                    candidate.generation,
                    candidate.genome,
                    candidate.recipe,
                    {"fitness": candidate.fitness, **candidate.metrics},
                    parent_trial=candidate.parent_candidate,
                )
                # Written at once (not left in the tracker's buffer): a forced shutdown must not lose candidates
                # that the progress already counts. One small transaction per candidate.
                self.tracker.flush()
            if self.jobs is not None and self.job_id is not None:
                self.jobs.update_progress(self.job_id, **self.summary.progress())
