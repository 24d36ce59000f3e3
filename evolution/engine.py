"""The evolution job engine (plain Python; the Serve deployment and the ``ray job submit`` driver are thin shells).

``run_job(job_id)`` takes an evolution job from the JobStore through PREPARING (resolve parents and fitness data,
load the parents once) -> RUNNING (the Ray Tune search, progress written per candidate) -> EVALUATING (finalists
re-scored on the whole dev split, the winner merged to disk, registered with its lineage and scored on the test
split next to every parent, fitness plot stored) -> COMPLETED. A cancel request ends it FAILED with code
``CANCELLED``. Replayed after a forced shutdown, the search continues from its Tune checkpoints.
"""

from __future__ import annotations

import logging
import shutil
import threading
from pathlib import Path
from typing import Any

from alloy.config import Settings
from alloy.errors import AlloyError, ErrorCode, not_found
from alloy.jobs.liveness import DEFAULT_HEARTBEAT_S
from alloy.jobs.records import JobKind, JobRecord, JobState
from alloy.jobs.skeleton import JobRun, JobRunner
from alloy.jobs.store import JobStore
from alloy.registry.datasets import DatasetRegistry
from alloy.registry.models import ModelRegistry
from alloy.storage.artifacts import ArtifactStore
from alloy.storage.db import Database
from alloy.storage.tracker import ExperimentTracker
from evolution.conclude import Conclusion, default_output_id, find_member
from evolution.config import EvolutionSpec, parse_spec
from evolution.finalize import lineage_of
from evolution.genome import GenomeSpace
from evolution.inputs import ResolvedInputs, genome_space, resolve_inputs, skeleton_dir
from evolution.parents import ParentArrays, load_parents
from evolution.runner import SearchOutcome, can_resume, run_search
from evolution.scoring import InMemoryDatasets, ScorerSpec
from evolution.search import cancel_flag, set_external_cancel_check
from evolution.tracking import Candidate, ProgressSummary, RecordingSink

log = logging.getLogger(__name__)

CANCELLED = ErrorCode.CANCELLED.value
EXPERIMENT_KIND = "evolution"


def experiment_id_for(job_id: str) -> str:
    return f"evolution-{job_id}"


class EvolutionService:
    def __init__(
        self,
        settings: Settings,
        *,
        db: Database,
        jobs: JobStore,
        tracker: ExperimentTracker,
        models: ModelRegistry | None,  # None: a reader (the HTTP routes list trials and cancel with one)
        datasets: DatasetRegistry | None = None,
        store: ArtifactStore | None = None,
        heartbeat_s: float = DEFAULT_HEARTBEAT_S,
    ):
        self.settings = settings
        self.heartbeat_s = heartbeat_s
        self.db = db
        self.jobs = jobs
        self.tracker = tracker
        self.models = models
        self.datasets = datasets
        self.store = store
        # The search has no cancel point of its own: a shutdown's cancel is not acted on, the drain requeues the
        # job and the replay resumes it from its Tune checkpoints.
        self.job_runner = JobRunner(
            jobs,
            JobKind.EVOLUTION,
            self._job_body,
            heartbeat_s=heartbeat_s,
            claim_progress={"stage": "preparing"},
            clean_lost_run=self.clean_lost_run,
        )

    @classmethod
    def from_settings(cls, settings: Settings) -> EvolutionService:
        db = Database.from_settings(settings)
        store = ArtifactStore.from_settings(settings)
        return cls(
            settings,
            db=db,
            jobs=JobStore(db),
            tracker=ExperimentTracker(db),
            models=ModelRegistry.from_settings(settings, db, store),
            datasets=DatasetRegistry(db, store),
            store=store,
        )

    @property
    def storage_path(self) -> Path:
        return self.settings.evolution_dir

    # ---- the job ------------------------------------------------------------------------------------------
    def run_job(self, job_id: str, cancel: threading.Event | None = None) -> dict[str, Any]:
        """Run (or resume) one evolution job to its end; returns the job's result (empty unless COMPLETED).
        Claim, heartbeat, endings and requeue are the job skeleton's; a second dispatch of a job another process
        runs returns at once (if that owner dies, a sweeper requeues and re-dispatches it)."""
        record = self.job_runner.run(job_id, cancel)
        return (record.result or {}) if record.state is JobState.COMPLETED else {}

    def _job_body(self, run: JobRun) -> dict[str, Any]:
        job_id = run.job_id
        set_external_cancel_check(job_id, lambda: run.lost.is_set() or self._cancel_requested(job_id))  # fenced
        run.on_exit(lambda: set_external_cancel_check(job_id, None))
        run.on_exit(self.tracker.flush)  # trials recorded before a failure are kept
        spec = parse_spec(run.record.request)
        inputs = self.resolve_inputs(spec)
        space = self.genome_space(spec, inputs)
        experiment_id = self._experiment(job_id, spec, space, run.record.owner)
        dev_data = InMemoryDatasets.read(inputs.source, inputs.dataset_ids, [spec.dev_split])
        parents = load_parents(inputs.parents)
        summary = ProgressSummary(generations=spec.search.generations, population=spec.search.population)
        for previous in self._recorded_candidates(experiment_id):  # a resumed run keeps its history
            summary.add(previous)
        # A replay after a forced shutdown continues the Tune experiment already on disk (Tuner.restore).
        resuming = can_resume(self.storage_path, job_id)
        run.transition(JobState.RUNNING, progress={**summary.progress(), "resumed_from_checkpoint": resuming})
        sink = RecordingSink(
            job_id=job_id, experiment_id=experiment_id, tracker=self.tracker, jobs=self.jobs, summary=summary
        )
        outcome = run_search(
            run_name=job_id,
            storage_path=self.storage_path,
            space=space,
            settings=spec.search,
            parents=parents,
            data=dev_data,
            device=self.settings.merge.device,
            sink=sink,
            scorer=ScorerSpec(
                run=job_id,
                model_dir=str(skeleton_dir(inputs)),
                dataset_ids=inputs.dataset_ids,
                split=spec.dev_split,
            ),
        )
        self.tracker.flush()
        if outcome.cancelled:
            raise AlloyError(ErrorCode.CANCELLED, "evolution cancelled on request")
        candidates = self._all_candidates(experiment_id, outcome)
        if not candidates:
            raise AlloyError(
                ErrorCode.INTERNAL_ERROR, "the search produced no candidate", {"errored_trials": outcome.errored_trials}
            )
        run.transition(JobState.EVALUATING, progress={"stage": "finalizing"})
        result = self._conclusion(spec, inputs, space, parents).finalize(job_id, experiment_id, candidates, outcome)
        self.tracker.flush()
        return result

    def _conclusion(
        self, spec: EvolutionSpec, inputs: ResolvedInputs, space: GenomeSpace, parents: ParentArrays
    ) -> Conclusion:
        return Conclusion(
            storage_path=self.storage_path,
            device=self.settings.merge.device,
            models=self._registry(),
            tracker=self.tracker,
            store=self.store,
            spec=spec,
            inputs=inputs,
            space=space,
            parents=parents,
        )

    def promote(self, job_id: str, candidate_id: str, model_id: str) -> dict[str, Any]:
        """Register the Pareto front member ``candidate_id`` of a completed evolution as ``model_id`` (merged to
        disk, registered with its lineage, scored once on the test split)."""
        job = self._evolution_job(job_id)
        if job.state is not JobState.COMPLETED:
            raise AlloyError(
                ErrorCode.CONFLICT,
                f"evolution {job_id!r} has not completed ({job.state.value})",
                {"job_id": job_id, "state": job.state.value},
            )
        member = find_member(job.result, job_id, candidate_id)
        spec = parse_spec(job.request)
        inputs = self.resolve_inputs(spec)
        space = self.genome_space(spec, inputs)
        experiment_id = experiment_id_for(job_id)
        chain = lineage_of(candidate_id, self._recorded_candidates(experiment_id))
        conclusion = self._conclusion(spec, inputs, space, load_parents(inputs.parents))
        record, test = conclusion.promote(job_id, experiment_id, member, model_id, chain)
        self.tracker.flush()
        return {
            "job_id": job_id,
            "candidate_id": candidate_id,
            "model": record.model_dump(mode="json"),
            "test": test,
        }

    def clean_lost_run(self, job: JobRecord) -> None:
        """What a lost run (its replica killed) left, removed when the job is requeued: the winner's merge
        folder and its staging sibling, the staging leftovers of the winner's registration. The Tune experiment
        folder stays: the replay resumes from it."""
        job_dir = self.storage_path / job.id
        for scratch in [job_dir / "model", *job_dir.glob(".model.staging-*")]:
            shutil.rmtree(scratch, ignore_errors=True)
        output = job.request.get("output_model_id") or default_output_id(job.id)
        self._registry().discard_unfinished(output, job.id)

    def cancel(self, job_id: str):
        """Ask a running evolution to stop (this process at once; another process within seconds)."""
        job = self.jobs.get(job_id)
        if job.state.terminal:
            raise AlloyError(
                ErrorCode.CONFLICT,
                f"evolution {job_id!r} already ended ({job.state.value})",
                {"job_id": job_id, "state": job.state.value},
            )
        cancel_flag(job_id).set()
        if job.state == JobState.CREATED:  # never started: nothing to stop
            return self.jobs.fail(job_id, CANCELLED, "evolution cancelled on request")
        return self.jobs.update_progress(job_id, cancel_requested=True)

    def _evolution_job(self, job_id: str) -> JobRecord:
        job = self.jobs.get(job_id)
        if job.kind.value != EXPERIMENT_KIND:
            raise not_found("evolution", job_id)
        return job

    def trials(self, job_id: str, generation: int | None = None) -> list[dict[str, Any]]:
        self._evolution_job(job_id)
        try:
            rows = self.tracker.trials(experiment_id_for(job_id), generation)
        except AlloyError as exc:
            if exc.code == ErrorCode.NOT_FOUND:
                return []  # not started yet
            raise
        rows = sorted(rows, key=lambda t: (t.generation, t.trial_id))
        return [t.model_dump(mode="json", exclude={"experiment_id", "lsn"}) for t in rows]

    # ---- inputs -------------------------------------------------------------------------------------------
    def resolve_inputs(self, spec: EvolutionSpec) -> ResolvedInputs:
        return resolve_inputs(
            spec, data_dir=self.settings.data_dir, models=self._registry(), datasets=self.datasets, store=self.store
        )

    def _registry(self) -> ModelRegistry:
        if self.models is None:
            raise AlloyError(ErrorCode.INTERNAL_ERROR, "this EvolutionService reads only: it has no model registry")
        return self.models

    def genome_space(self, spec: EvolutionSpec, inputs: ResolvedInputs) -> GenomeSpace:
        return genome_space(spec, inputs)

    # ---- records ------------------------------------------------------------------------------------------
    def _experiment(self, job_id: str, spec: EvolutionSpec, space: GenomeSpace, owner: str | None) -> str:
        experiment_id = experiment_id_for(job_id)
        try:
            self.tracker.get_experiment(experiment_id)
        except AlloyError as exc:
            if exc.code != ErrorCode.NOT_FOUND:
                raise
            params = {
                "job_id": job_id,
                "request": spec.model_dump(mode="json"),
                "parents": space.models,
                "base_model": space.base_model,
                "genes": [g.name for g in space.genes()],
            }
            self.tracker.create_experiment(
                spec.name or f"evolution {job_id}", EXPERIMENT_KIND, params, owner=owner, experiment_id=experiment_id
            )
        return experiment_id

    def _recorded_candidates(self, experiment_id: str) -> list[Candidate]:
        out = []
        for trial in self.tracker.trials(experiment_id):
            metrics = dict(trial.metrics)
            fitness = metrics.pop("fitness", None)
            if fitness is None:
                continue
            out.append(
                Candidate(
                    candidate_id=trial.trial_id,
                    trial_id=trial.trial_id.rsplit("-g", 1)[0],
                    generation=trial.generation,
                    fitness=float(fitness),
                    genome=trial.genome,
                    recipe=trial.recipe,
                    metrics=metrics,
                    parent_candidate=trial.parent_trial,
                )
            )
        return out

    def _all_candidates(self, experiment_id: str, outcome: SearchOutcome) -> list[Candidate]:
        merged = {c.candidate_id: c for c in self._recorded_candidates(experiment_id)}
        merged.update({c.candidate_id: c for c in outcome.candidates})
        return sorted(merged.values(), key=lambda c: (c.generation, c.candidate_id))

    def _cancel_requested(self, job_id: str) -> bool:
        try:
            return bool(self.jobs.get(job_id).progress.get("cancel_requested"))
        except AlloyError:
            return False
