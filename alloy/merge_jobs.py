"""Merge jobs end to end, without Ray: the request, its synchronous validation, and the runner that takes a job
from CREATED to COMPLETED (or FAILED) while writing every step to the JobStore.

The HTTP ingress calls :func:`validate_merge_request` before it creates a job, so a client learns about a bad
strategy, a missing model or incompatible shapes at once. The MergeEngine deployment calls
:meth:`MergeJobRunner.run` for a job id; the runner re-validates (the registry may have changed meanwhile),
resolves sources, merges into a private work folder, optionally evaluates, and registers the output only as
the last step before COMPLETED, so a FAILED job leaves nothing registered and no visible artifact.

Interruption: the runner owns its job only while it keeps the job's heartbeat fresh. A cancel (replica shutting
down) requeues the job with an ``interrupted`` event; a replica that died without a word is detected later by
:func:`alloy.job_liveness.sweep_orphans` from the stale heartbeat and its job is requeued the same way, then replayed.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from alloy.errors import AlloyError, ErrorCode
from alloy.job_liveness import JobHeartbeat
from alloy.jobs import JobKind, JobRecord, JobState, JobStore
from alloy.model_cache import CachedModel, ModelCache
from kernels.registry import METHODS

logger = logging.getLogger("alloy.merge_jobs")

# The merge methods (mergekit names), each a variant of one strategy family: an enum in the OpenAPI schema.
MethodName = Literal[tuple(sorted(METHODS))]  # type: ignore[valid-type]

MODEL_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}(/[A-Za-z0-9][A-Za-z0-9._-]{0,127})?$"


class EvaluateSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    datasets: list[str] = Field(min_length=1, max_length=16, description="Registered dataset ids")
    split: str = Field("test", description="Dataset split to evaluate on")


class MergeRequest(BaseModel):
    """Body of POST /merge/execute."""

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={"examples": [{"models": ["tiny-a", "tiny-b"], "strategy": "ties",
                                         "parameters": {"density": 0.5}, "output_model_id": "my-merge"}]},
    )

    models: list[str] = Field(min_length=2, max_length=8, description="Model ids to merge (2-8)")
    strategy: str = Field(description="slerp | ties | dare | task_arithmetic | franken_merge (anything else: "
                                      "422 INVALID_STRATEGY)")
    variant: MethodName | None = Field(
        None, description="A merge method of the strategy's family, by its mergekit name (GET /methods lists them). "
                          "Default: the family's own method; ties with epsilon > 0 is della (DELLA's MagPrune), "
                          "dare with consensus: true is dare_ties, otherwise dare_linear")
    parameters: dict[str, Any] = Field(default_factory=dict, description="Strategy parameters (global)")
    output_model_id: str = Field(pattern=MODEL_ID_PATTERN, description="ID of the merged model; must be new")
    base_model: str | None = Field(None, description="Base model for task vectors (ties, dare, task_arithmetic)")
    model_parameters: dict[str, dict[str, Any]] | None = Field(None, description="Per-model parameters")
    slices: list[dict[str, Any]] | None = Field(
        None, description="Output slices: franken_merge shorthand [{model, layer_range}], or mergekit's "
                          "[{sources: [{model, layer_range, parameters}], parameters, base_model}] for any strategy")
    dtype: str | None = Field(None, description="float32 | float16 | bfloat16")
    seed: int | None = Field(None, description="Seed for stochastic strategies (dare)")
    evaluate: EvaluateSpec | None = Field(None, description="Evaluate the merged model before COMPLETED")

    def recipe(self):
        from alloy.merge.recipe import MergeRecipe, validate_recipe

        fields = self.model_dump(exclude={"output_model_id", "evaluate"})
        return validate_recipe(MergeRecipe.from_request_fields(**fields))


# --- synchronous validation ---------------------------------------------------------------------------------

def check_merge_inputs(request: MergeRequest, recipe, *, output_taken: bool, manifests: dict[str, Any]) -> None:
    """The checks that need the registry, given what it answered: ALREADY_EXISTS (output id registered or being
    produced by another job), INCOMPATIBLE_MODELS. (MODEL_NOT_FOUND comes from fetching ``manifests``.)"""
    from alloy.merge.executor import check_compatibility

    if request.output_model_id in recipe.model_ids:
        raise AlloyError(ErrorCode.VALIDATION_FAILED, "output_model_id must differ from the input models",
                         {"field": "output_model_id"})
    if output_taken:
        raise AlloyError(ErrorCode.ALREADY_EXISTS, f"model {request.output_model_id!r} already exists",
                         {"field": "output_model_id", "model_id": request.output_model_id})
    check_compatibility(recipe, manifests)


def validate_merge_request(request: MergeRequest, *, models, jobs: JobStore | None = None):
    """Everything that can be checked before a job exists, against a plain ModelRegistry: INVALID_STRATEGY,
    VALIDATION_FAILED, ALREADY_EXISTS, MODEL_NOT_FOUND, INCOMPATIBLE_MODELS. Returns the validated recipe."""
    recipe = request.recipe()
    taken = models.exists(request.output_model_id) or (
        jobs is not None and request.output_model_id in active_merge_outputs(jobs)
    )
    manifests = {model_id: models.manifest(model_id) for model_id in recipe.model_ids}
    check_merge_inputs(request, recipe, output_taken=taken, manifests=manifests)
    return recipe


def active_merge_outputs(jobs: JobStore) -> set[str]:
    return {job.request.get("output_model_id") for job in jobs.active(kind=JobKind.MERGE)}


# --- the runner ---------------------------------------------------------------------------------------------

# The states a runner holds its job in (CREATED -> PREPARING is how it takes ownership).
RUNNER_STATES = frozenset({JobState.PREPARING, JobState.RUNNING, JobState.EVALUATING})


class JobInterrupted(Exception):
    """Raised inside the runner when its cancel event is set."""


class MergeJobRunner:
    """Runs one merge job per :meth:`run` call; thread-safe (one call per thread)."""

    def __init__(
        self,
        jobs: JobStore,
        models,  # alloy.registry.models.ModelRegistry
        work_dir: Path,
        *,
        cache_bytes: int = 0,
        device: str = "cpu",
        shard_bytes: int | None = None,
        max_in_flight: int | None = None,
        evaluate: Callable[[Path, MergeRequest], dict[str, Any]] | None = None,
        heartbeat_s: float = 5.0,
    ):
        self.jobs = jobs
        self.models = models
        self.work_dir = Path(work_dir)
        self.cache = ModelCache(self._resolve, capacity_bytes=cache_bytes)  # input models kept across jobs
        self.device = device
        self.shard_bytes = shard_bytes
        self.max_in_flight = max_in_flight
        self.evaluate = evaluate
        self.heartbeat_s = heartbeat_s
        self.running: dict[str, threading.Event] = {}
        self._lock = threading.Lock()

    def _resolve(self, model_id: str) -> CachedModel:
        manifest = self.models.manifest(model_id)
        return CachedModel(model_id, Path(self.models.local_dir(model_id)), manifest, int(manifest.size_bytes))

    # The public entry point: never raises for a job-level failure; the job records it.
    def run(self, job_id: str, cancel: threading.Event | None = None) -> JobRecord:
        cancel = cancel or threading.Event()
        try:
            self.jobs.transition(job_id, JobState.PREPARING, progress={"stage": "preparing"})
        except AlloyError as exc:
            if exc.code is ErrorCode.CONFLICT:  # someone else owns it, or it already ended: nothing to do
                return self.jobs.get(job_id)
            raise
        attempt = self.jobs.get(job_id).attempts  # which run of the job this is: a requeue increments it
        with self._lock:
            self.running[job_id] = cancel
        out_dir = self.work_dir / f"{job_id}-{uuid.uuid4().hex[:8]}"
        heartbeat = JobHeartbeat(self.jobs, job_id, self.heartbeat_s)
        registered: str | None = None
        try:
            heartbeat.start()
            request = MergeRequest.model_validate(self.jobs.get(job_id).request)
            recipe, sources = self._prepare(request)
            self._check_cancel(cancel)
            result = self._merge(job_id, recipe, sources, out_dir, cancel)
            evaluation = None
            if request.evaluate is not None and self.evaluate is not None:
                self.jobs.transition(job_id, JobState.EVALUATING, progress={"stage": "evaluating"})
                evaluation = self.evaluate(out_dir, request)
                self._check_cancel(cancel)
            heartbeat.stop()
            record = self.models.register(
                request.output_model_id, str(out_dir),
                lineage={"job_id": job_id, "strategy": recipe.strategy, "method": recipe.variant,
                         "models": recipe.model_ids,
                         "parameters": recipe.parameters},
            )
            registered = request.output_model_id
            # Scratch goes before COMPLETED, so that a completed job never leaves anything behind it.
            shutil.rmtree(out_dir, ignore_errors=True)
            return self.jobs.complete(job_id, {
                "model_id": record.id, "evaluation": evaluation, **result,
            })
        except JobInterrupted:
            return self._interrupted(job_id, "replica shutting down: merge cancelled", registered)
        except AlloyError as exc:
            if exc.code is ErrorCode.CONFLICT and self._lost_ownership(job_id, attempt):
                return self._abandoned(job_id, registered)
            return self._failed(job_id, exc.code, exc.message, registered)
        except Exception as exc:  # noqa: BLE001 - any crash becomes a FAILED job, logged with its traceback
            logger.exception("merge job %s crashed", job_id)
            return self._failed(job_id, ErrorCode.INTERNAL_ERROR, f"merge failed: {type(exc).__name__}: {exc}",
                                registered)
        finally:
            heartbeat.stop()
            with self._lock:
                self.running.pop(job_id, None)
            shutil.rmtree(out_dir, ignore_errors=True)

    def interrupt_all(self) -> list[str]:
        """Cancel every job this runner is executing (replica shutdown); each records itself as interrupted."""
        with self._lock:
            events = dict(self.running)
        for event in events.values():
            event.set()
        return list(events)

    # -- steps ---------------------------------------------------------------------------------------------
    def _prepare(self, request: MergeRequest):
        from alloy.merge.executor import check_compatibility

        recipe = request.recipe()
        if self.models.exists(request.output_model_id):
            raise AlloyError(ErrorCode.ALREADY_EXISTS, f"model {request.output_model_id!r} already exists",
                             {"model_id": request.output_model_id})
        resolved = {model_id: self.cache.get(model_id) for model_id in recipe.model_ids}
        check_compatibility(recipe, {model_id: entry.manifest for model_id, entry in resolved.items()})
        return recipe, {model_id: entry.local_dir for model_id, entry in resolved.items()}

    def _merge(self, job_id: str, recipe, sources: dict[str, Path], out_dir: Path,
               cancel: threading.Event) -> dict[str, Any]:
        from alloy.merge.executor import execute_merge

        self.jobs.transition(job_id, JobState.RUNNING, progress={"stage": "merging"})
        reporter = _ProgressReporter(self.jobs, job_id)
        kwargs: dict[str, Any] = {"device": self.device, "progress": reporter, "cancel": cancel}
        if self.shard_bytes:
            kwargs["shard_bytes"] = self.shard_bytes
        if self.max_in_flight:
            kwargs["max_in_flight"] = self.max_in_flight
        try:
            outcome = execute_merge(recipe, sources, out_dir, **kwargs)
        except AlloyError:
            raise
        except Exception:
            if cancel.is_set():
                raise JobInterrupted() from None
            raise
        self._check_cancel(cancel)
        reporter.flush()
        return _summary(outcome)

    @staticmethod
    def _check_cancel(cancel: threading.Event) -> None:
        if cancel.is_set():
            raise JobInterrupted()

    # -- endings -------------------------------------------------------------------------------------------
    def _unregister(self, model_id: str | None) -> None:
        if model_id is None:
            return
        try:
            self.models.delete(model_id)
        except AlloyError:
            logger.exception("could not remove %s after a failed job", model_id)

    def _failed(self, job_id: str, code: ErrorCode, message: str, registered: str | None) -> JobRecord:
        self._unregister(registered)
        try:
            return self.jobs.fail(job_id, code, message)
        except AlloyError:  # already terminal (or requeued by a sweeper): leave the record as it is
            return self.jobs.get(job_id)

    def _lost_ownership(self, job_id: str, attempt: int) -> bool:
        """Whether someone else moved the job while this run held it: requeued (a forced stop, a sweeper, the
        start-time recovery) or ended. Then the job is no longer this run's to finish or to fail."""
        current = self.jobs.get(job_id)
        return current.attempts != attempt or current.state not in RUNNER_STATES

    def _abandoned(self, job_id: str, registered: str | None) -> JobRecord:
        """Give the job up without touching its record: failing it would be legal from CREATED and would end a
        requeued job FAILED. Only this run's own output is removed (the private work folder goes in ``run``)."""
        logger.warning("merge job %s was moved by someone else while it ran: leaving it as it is", job_id)
        self._unregister(registered)
        return self.jobs.get(job_id)

    def _interrupted(self, job_id: str, reason: str, registered: str | None) -> JobRecord:
        self._unregister(registered)
        try:
            return self.jobs.requeue(job_id, reason)
        except AlloyError:
            return self.jobs.get(job_id)


def _summary(outcome: Any) -> dict[str, Any]:
    """The executor's MergeResult as plain JSON fields (whatever subset it carries)."""
    if outcome is None:
        return {}
    if hasattr(outcome, "model_dump"):
        data = outcome.model_dump(mode="json")
    elif hasattr(outcome, "__dict__"):
        data = {k: v for k, v in vars(outcome).items() if not k.startswith("_")}
    else:
        return {}
    keep = ("tensors", "bytes", "seconds")
    return {"merge": {k: _jsonable(v) for k, v in data.items() if k in keep}}


def _jsonable(value: Any) -> Any:
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return str(value)


class _ProgressReporter:
    """The executor's progress callback -> JobStore, throttled so a fast merge of thousands of tensors does
    not turn into thousands of database writes."""

    def __init__(self, jobs: JobStore, job_id: str, min_interval_s: float = 0.5):
        self.jobs = jobs
        self.job_id = job_id
        self.min_interval_s = min_interval_s
        self.started = time.monotonic()
        self._last_write = 0.0
        self._pending: dict[str, Any] | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        update = _progress_fields(args[0] if args else kwargs)
        if not update:
            return
        elapsed = max(time.monotonic() - self.started, 1e-6)
        if "bytes_done" in update:
            update["bytes_per_s"] = update["bytes_done"] / elapsed
        total, done = update.get("tensors_total"), update.get("tensors_done")
        if total:
            update["percent"] = round(100.0 * (done or 0) / total, 2)
        self._pending = update
        now = time.monotonic()
        if now - self._last_write >= self.min_interval_s or (total and done == total):
            self.flush()

    def flush(self) -> None:
        if self._pending is None:
            return
        update, self._pending = self._pending, None
        self._last_write = time.monotonic()
        try:
            self.jobs.update_progress(self.job_id, **update)
        except AlloyError:
            logger.warning("progress for %s not recorded", self.job_id, exc_info=True)


PROGRESS_KEYS = ("tensors_done", "tensors_total", "bytes_done", "bytes_total", "shards_done", "shards_total")


def _progress_fields(event: Any) -> dict[str, Any]:
    if isinstance(event, dict):
        source = event
    elif hasattr(event, "model_dump"):
        source = event.model_dump()
    else:
        source = {k: getattr(event, k) for k in PROGRESS_KEYS if hasattr(event, k)}
    return {k: source[k] for k in PROGRESS_KEYS if source.get(k) is not None}
