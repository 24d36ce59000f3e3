"""EvaluationService: evaluate registered models (or folders) on registered datasets; run evaluation jobs.

Plain Python over the storage services (ModelRegistry, DatasetRegistry, ExperimentTracker, JobStore,
ArtifactStore); the Ray Serve deployment ``deployments/evaluation_engine.py`` is a thin shell over it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, Field, ValidationError, model_validator

from alloy.errors import from_validation_error, model_not_found, validation_failed
from alloy.evaluation.candidate import CandidateEvaluator, prepare_for_model
from alloy.evaluation.dataset_sources import DatasetSource, RegistryDatasets
from alloy.evaluation.loaded_model_cache import LoadedModelCache
from alloy.evaluation.loading import LoadedModel, load_model
from alloy.evaluation.results import EvalResult
from alloy.jobs.liveness import DEFAULT_HEARTBEAT_S
from alloy.jobs.records import JobKind, JobRecord, JobState
from alloy.jobs.skeleton import JobRun, JobRunner
from alloy.jobs.store import JobStore
from alloy.registry.datasets import DatasetRegistry
from alloy.registry.models import ModelRegistry
from alloy.storage.artifacts import ArtifactStore
from alloy.storage.tracker import ExperimentTracker

log = logging.getLogger(__name__)

DEFAULT_BATCH_SIZE = 32
Progress = Callable[[dict[str, Any]], None]


class EvaluationRequest(BaseModel):
    """The request of an evaluation job (POST /evaluations): one model (``model_id``) or several (``models``),
    each scored on every dataset."""

    model_id: str | None = Field(None, min_length=1)
    models: list[str] | None = Field(None, min_length=1, max_length=16)
    datasets: list[str] = Field(min_length=1, max_length=64)
    split: str = Field("test", min_length=1)
    batch_size: int | None = Field(None, ge=1, le=1024)
    experiment_id: str | None = None

    @model_validator(mode="after")
    def _one_model_form(self) -> EvaluationRequest:
        if (self.model_id is None) == (self.models is None):
            raise ValueError("give either model_id or models")
        return self

    @property
    def model_ids(self) -> list[str]:
        return [self.model_id] if self.model_id is not None else list(dict.fromkeys(self.models or []))


def parse_request(request: dict[str, Any]) -> EvaluationRequest:
    try:
        return EvaluationRequest.model_validate(request)
    except ValidationError as exc:
        raise from_validation_error(exc, "invalid evaluation request") from None


class EvaluationService:
    def __init__(
        self,
        models: ModelRegistry | None,
        datasets: DatasetRegistry | None,
        tracker: ExperimentTracker | None,
        jobs: JobStore | None,
        store: ArtifactStore | None = None,
        *,
        cache_capacity: int = 2,
        batch_size: int = DEFAULT_BATCH_SIZE,
        dataset_source: DatasetSource | None = None,
        heartbeat_s: float = DEFAULT_HEARTBEAT_S,
    ):
        self.models = models
        self.datasets = datasets
        self.tracker = tracker
        self.jobs = jobs
        self.store = store
        self.batch_size = batch_size
        if dataset_source is None and datasets is None:
            raise ValueError("an EvaluationService needs a dataset registry or a dataset source")
        self.source: DatasetSource = dataset_source or RegistryDatasets(datasets, store)
        self.cache = LoadedModelCache(cache_capacity)
        self.last_experiment_id: str | None = None
        # Without a job store (a merge's EVALUATING step, `alloy evaluate`), the service scores folders only.
        self._job_runner = (
            JobRunner(
                jobs,
                JobKind.EVALUATION,
                self._job_body,
                heartbeat_s=heartbeat_s,
                claim_progress={"percent": 0.0, "stage": "loading"},
            )
            if jobs is not None
            else None
        )

    @property
    def registry(self) -> ModelRegistry:
        if self.models is None:
            raise RuntimeError("this EvaluationService scores model folders only: it has no model registry")
        return self.models

    @property
    def job_runner(self) -> JobRunner:
        if self._job_runner is None:
            raise RuntimeError("this EvaluationService scores model folders only: it has no job store")
        return self._job_runner

    # -- models ---------------------------------------------------------------------------------------------
    def _load_registered(self, model_id: str) -> LoadedModel:
        if not self.registry.exists(model_id):
            raise model_not_found(model_id)
        # local_dir verifies the files against their registered sha256 (and refuses a broken model)
        return self.cache.get(f"id:{model_id}", lambda: load_model(self.registry.local_dir(model_id), model_id))

    def cache_stats(self) -> dict[str, float]:
        return self.cache.stats().model_dump()

    def clear_cache(self) -> int:
        return self.cache.clear()

    # -- evaluation -----------------------------------------------------------------------------------------
    def evaluate_model(
        self,
        model_id: str,
        dataset_ids: Sequence[str],
        split: str = "test",
        batch_size: int | None = None,
        experiment_id: str | None = None,
        progress: Progress | None = None,
    ) -> list[EvalResult]:
        """Score a registered model on registered datasets; results are logged to the tracker."""
        loaded = self._load_registered(model_id)
        return self._evaluate(loaded, model_id, dataset_ids, split, batch_size, experiment_id, progress)

    def evaluate_dir(
        self,
        model_dir: str | Path,
        dataset_ids: Sequence[str],
        split: str = "test",
        batch_size: int | None = None,
        model_id: str | None = None,
        experiment_id: str | None = None,
        progress: Progress | None = None,
    ) -> list[EvalResult]:
        """Score a model folder (not necessarily registered); ``model_id`` names it in the records."""
        model_dir = Path(model_dir)
        loaded = self.cache.get(f"dir:{model_dir.resolve()}", lambda: load_model(model_dir))
        return self._evaluate(
            loaded, model_id or str(model_dir), dataset_ids, split, batch_size, experiment_id, progress
        )

    def candidate_evaluator(
        self,
        base_model_id: str,
        dataset_ids: Sequence[str],
        split: str = "dev",
        *,
        max_examples: int | None = None,
        batch_size: int | None = None,
        seed: int = 0,
    ) -> CandidateEvaluator:
        """A CandidateEvaluator whose skeleton is the registered model ``base_model_id``."""
        if not self.registry.exists(base_model_id):
            raise model_not_found(base_model_id)
        return CandidateEvaluator(
            self.registry.local_dir(base_model_id),
            self.source,
            dataset_ids,
            split,
            batch_size=batch_size or self.batch_size,
            max_examples=max_examples,
            seed=seed,
        )

    def _evaluate(
        self,
        loaded: LoadedModel,
        model_id: str,
        dataset_ids: Sequence[str],
        split: str,
        batch_size: int | None,
        experiment_id: str | None,
        progress: Progress | None,
    ) -> list[EvalResult]:
        if not dataset_ids:
            raise validation_failed("at least one dataset is required")
        prepared = prepare_for_model(loaded, self.source, list(dataset_ids), split)
        if experiment_id is None:
            experiment_id = self._new_experiment(model_id, dataset_ids, split)
        self.last_experiment_id = experiment_id
        results = []
        for done, dataset in enumerate(prepared):
            started = time.perf_counter()
            score = dataset.score(loaded.model, None, batch_size or self.batch_size)
            result = EvalResult(
                model_id=model_id,
                dataset_id=dataset.dataset_id,
                split=split,
                metric=score.metric,
                value=score.value,
                n=score.n,
                duration_s=round(time.perf_counter() - started, 3),
            )
            results.append(result)
            self._log(experiment_id, result)
            if progress is not None:
                progress(
                    {
                        "percent": round(100.0 * (done + 1) / len(prepared), 1),
                        "datasets_done": done + 1,
                        "datasets_total": len(prepared),
                        "last": result.model_dump(),
                    }
                )
        self._flush()
        return results

    # -- jobs -----------------------------------------------------------------------------------------------
    def run_job(self, job_id: str, cancel: threading.Event | None = None) -> JobRecord:
        """Run evaluation job ``job_id``: CREATED -> PREPARING -> RUNNING -> COMPLETED, or FAILED with a code
        (through the job skeleton: claim, heartbeat, cancel between datasets, requeue on shutdown)."""
        return self.job_runner.run(job_id, cancel)

    def _job_body(self, run: JobRun) -> dict[str, Any]:
        request = parse_request(run.record.request)
        for model_id in request.model_ids:  # fail before RUNNING on anything unknown, broken or damaged
            if not self.registry.exists(model_id):
                raise model_not_found(model_id)
            self.registry.local_dir(model_id)
        for dataset_id in request.datasets:
            self.source.load(dataset_id, request.split)
        run.transition(JobState.RUNNING, progress={"stage": "scoring"})
        started = time.perf_counter()
        experiment_id = request.experiment_id or self._new_experiment(
            ",".join(request.model_ids), request.datasets, request.split, run.job_id
        )
        results: list[EvalResult] = []
        share = 100.0 / len(request.model_ids)
        for index, model_id in enumerate(request.model_ids):
            report = _job_progress(run, model_id, index * share, share)
            results += self.evaluate_model(
                model_id, request.datasets, request.split, request.batch_size, experiment_id, report
            )
        return result_summary(results, experiment_id, time.perf_counter() - started)

    # -- tracker --------------------------------------------------------------------------------------------
    def _new_experiment(
        self, model_id: str, dataset_ids: Sequence[str], split: str, job_id: str | None = None
    ) -> str | None:
        if self.tracker is None:
            return None
        return self.tracker.create_experiment(
            name=f"evaluate {model_id}",
            kind="evaluation",
            params={"model_id": model_id, "datasets": list(dataset_ids), "split": split, "job_id": job_id},
        )

    def _log(self, experiment_id: str | None, result: EvalResult) -> None:
        if self.tracker is not None and experiment_id is not None:
            self.tracker.log_result(
                experiment_id,
                result.model_id,
                result.dataset_id,
                result.split,
                result.metric,
                result.value,
                result.duration_s,
            )

    def _flush(self) -> None:
        if self.tracker is not None:
            self.tracker.flush()


def _job_progress(run: JobRun, model_id: str, offset: float, share: float) -> Progress:
    """Per-dataset progress of one model as the job's overall percent; a cancelled run stops here, between
    datasets (the scoring of one dataset is not interruptible)."""

    def report(update: dict[str, Any]) -> None:
        run.check_cancel()
        run.jobs.update_progress(
            run.job_id,
            **{**update, "model_id": model_id, "percent": round(offset + update["percent"] * share / 100, 1)},
        )

    return report


def result_summary(results: Sequence[EvalResult], experiment_id: str | None, duration_s: float) -> dict[str, Any]:
    return {
        "experiment_id": experiment_id,
        "results": [r.model_dump() for r in results],
        "duration_s": round(duration_s, 3),
    }


def configure_threads(threads: int) -> None:
    """One torch thread per evaluation worker is fastest on shared CPUs (see the benchmark notes)."""
    torch.set_num_threads(max(1, threads))
