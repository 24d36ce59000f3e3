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
import time
from pathlib import Path
from typing import Any

from alloy.errors import AlloyError, ErrorCode, not_found
from alloy.jobs.liveness import DEFAULT_HEARTBEAT_S
from alloy.jobs.skeleton import JobRun, JobRunner
from alloy.jobs.store import JobKind, JobRecord, JobState, JobStore
from alloy.merge.executor import execute_merge, merge_state_dicts
from alloy.registry.datasets import DatasetRegistry
from alloy.registry.models import ModelRegistry
from alloy.storage.artifacts import ArtifactStore
from alloy.storage.db import Database
from alloy.storage.tracker import ExperimentTracker
from evolution.config import EvolutionSpec, parse_spec
from evolution.finalize import Finalist, finalists, lineage_of, plot_fitness
from evolution.genome import GenomeSpace
from evolution.inputs import ResolvedInputs, genome_space, resolve_inputs, skeleton_dir
from evolution.parents import ParentArrays, as_tensors, load_parents, load_state_dict_arrays
from evolution.runner import SearchOutcome, can_resume, run_search
from evolution.scoring import CandidateScorer, InMemoryDatasets, ScorerSpec
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
        settings,
        *,
        db,
        jobs,
        tracker,
        models,
        datasets=None,
        store=None,
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
    def from_settings(cls, settings) -> EvolutionService:
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
        result = self._finalize(job_id, spec, inputs, space, parents, candidates, outcome, experiment_id)
        self.tracker.flush()
        return result

    def clean_lost_run(self, job: JobRecord) -> None:
        """What a lost run (its replica killed) left, removed when the job is requeued: the winner's merge
        folder and its staging sibling, the staging leftovers of the winner's registration. The Tune experiment
        folder stays: the replay resumes from it."""
        job_dir = self.storage_path / job.id
        for scratch in [job_dir / "model", *job_dir.glob(".model.staging-*")]:
            shutil.rmtree(scratch, ignore_errors=True)
        output = job.request.get("output_model_id") or _default_output_id(job.id)
        self.models.discard_unfinished(output, job.id)

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

    def trials(self, job_id: str, generation: int | None = None) -> list[dict[str, Any]]:
        job = self.jobs.get(job_id)
        if job.kind.value != EXPERIMENT_KIND:
            raise not_found("evolution", job_id)
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
            spec, data_dir=self.settings.data_dir, models=self.models, datasets=self.datasets, store=self.store
        )

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

    # ---- the end ------------------------------------------------------------------------------------------
    def _finalize(
        self,
        job_id: str,
        spec: EvolutionSpec,
        inputs: ResolvedInputs,
        space: GenomeSpace,
        parents: ParentArrays,
        candidates: list[Candidate],
        outcome: SearchOutcome,
        experiment_id: str,
    ) -> dict[str, Any]:
        started = time.perf_counter()
        tensors = as_tensors(parents)
        skeleton = str(skeleton_dir(inputs))
        data = InMemoryDatasets.read(inputs.source, inputs.dataset_ids, [spec.dev_split, spec.test_split])
        dev = CandidateScorer(
            ScorerSpec(model_dir=skeleton, dataset_ids=inputs.dataset_ids, split=spec.dev_split), data
        )
        chosen: list[Finalist] = finalists(candidates, spec.search.finalists)
        for finalist in chosen:
            recipe = space.decode(finalist.candidate.genome)
            finalist.dev_metrics = dev.score(merge_state_dicts(recipe, tensors, device=self.settings.merge.device))
            finalist.dev_fitness = finalist.dev_metrics["fitness"]
        winner = max(chosen, key=lambda f: f.dev_fitness)
        recipe = space.decode(winner.candidate.genome)

        out_dir = self.storage_path / job_id / "model"
        if out_dir.exists():  # a replay that died while finalizing
            shutil.rmtree(out_dir)
        execute_merge(
            recipe, {m: Path(p) for m, p in inputs.parents.items()}, out_dir, device=self.settings.merge.device
        )
        _copy_tokenizer(Path(skeleton), out_dir)
        model_id = spec.output_model_id or _default_output_id(job_id)
        chain = lineage_of(winner.candidate.candidate_id, candidates)
        lineage = {
            "kind": "evolution",
            "job_id": job_id,
            "experiment_id": experiment_id,
            "trial_id": winner.candidate.candidate_id,
            "lineage": chain,
            "parents": space.models,
            "base_model": space.base_model,
            "recipe": recipe.model_dump(mode="json", exclude_none=True),
            "search": spec.search.kind,
        }
        if not self.models.exists(model_id):
            self.models.register(model_id, str(out_dir), lineage=lineage)

        test = CandidateScorer(
            ScorerSpec(model_dir=skeleton, dataset_ids=inputs.dataset_ids, split=spec.test_split), data
        )
        test_scores = {model_id: test.evaluator.score(_load_dir_tensors(out_dir))}
        for parent_id in space.models:
            test_scores[parent_id] = test.evaluator.score(tensors[parent_id])
        if space.base_model:
            test_scores[space.base_model] = test.evaluator.score(tensors[space.base_model])
        mean_key = f"mean_{test.metric}"
        for scored_model, metrics in test_scores.items():
            for dataset_id, value in metrics.items():
                self.tracker.log_result(
                    experiment_id,
                    scored_model,
                    None if dataset_id.startswith("mean_") else dataset_id,
                    spec.test_split,
                    test.metric if not dataset_id.startswith("mean_") else dataset_id,
                    float(value),
                )

        plot = self._store_plot(job_id, candidates, spec)
        best_parent = max(space.models, key=lambda m: test.sign * test_scores[m][mean_key])
        evolved_test = test_scores[model_id][mean_key]
        return {
            "model_id": model_id,
            "experiment_id": experiment_id,
            "best_trial": winner.candidate.candidate_id,
            "lineage": chain,
            "recipe": lineage["recipe"],
            "genome": winner.candidate.genome,
            "dev_fitness": winner.dev_fitness,
            "finalists": [
                {
                    "trial": f.candidate.candidate_id,
                    "mean_batch_fitness": f.mean_batch_fitness,
                    "evaluations": f.evaluations,
                    "dev_fitness": f.dev_fitness,
                }
                for f in chosen
            ],
            "test": {
                "metric": mean_key,
                "scores": {m: s[mean_key] for m, s in test_scores.items()},
                "per_dataset": test_scores,
                "best_parent": best_parent,
                "beats_every_parent": all(
                    test.sign * evolved_test > test.sign * test_scores[m][mean_key] for m in space.models
                ),
            },
            "fitness_plot": plot,
            "search": {
                "kind": spec.search.kind,
                "population": spec.search.population,
                "generations": spec.search.generations,
                "candidates": len(candidates),
                "evaluated_this_run": len(outcome.candidates),
                "resumed": outcome.resumed,
                "search_wall_s": round(outcome.wall_s, 2),
                "candidates_per_minute": round(len(outcome.candidates) / max(outcome.wall_s, 1e-9) * 60, 2),
                "errored_trials": outcome.errored_trials,
            },
            "finalize_s": round(time.perf_counter() - started, 2),
        }

    def _store_plot(self, job_id: str, candidates: list[Candidate], spec: EvolutionSpec) -> dict[str, Any]:
        path = plot_fitness(
            candidates,
            self.storage_path / job_id / "fitness.png",
            title=f"{spec.name or job_id}: fitness by generation ({spec.search.kind})",
        )
        if self.store is None:
            return {"path": str(path)}
        info = self.store.put_file(f"evolutions/{job_id}/fitness.png", path)
        return {"key": info.key, "uri": info.uri, "size": info.size, "sha256": info.sha256}


def _default_output_id(job_id: str) -> str:
    return f"evolved-{job_id[:24]}"


def _copy_tokenizer(source: Path, out_dir: Path) -> None:
    """The merged folder must be loadable on its own (evaluation needs the tokenizer files)."""
    for name in (
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "vocab.txt",
        "tokenizer.model",
        "merges.txt",
        "vocab.json",
    ):
        if (source / name).exists() and not (out_dir / name).exists():
            shutil.copy2(source / name, out_dir / name)


def _load_dir_tensors(model_dir: Path):
    return as_tensors({"m": load_state_dict_arrays(model_dir)})["m"]
