"""The merge job's body, run by the job skeleton (:mod:`alloy.jobs.skeleton`); plain Python, no Ray.

The body re-validates the request (the registry may have changed since the ingress checked it), resolves the
sources through a model cache, merges into a private work folder, optionally evaluates, and registers the
output only as the last step before COMPLETED, so a FAILED job leaves nothing registered and no visible
artifact. Claim, heartbeat, endings, cancel and requeue are the skeleton's.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from alloy.errors import AlloyError, ErrorCode
from alloy.jobs.merge_request import MergeRequest
from alloy.jobs.skeleton import JobInterrupted, JobRun, JobRunner
from alloy.jobs.store import JobKind, JobRecord, JobState, JobStore
from alloy.merge.executor import MergeProgress, MergeResult, check_compatibility, execute_merge
from alloy.merge.recipe import MergeRecipe
from alloy.registry.models import ModelRegistry
from alloy.storage.model_cache import CachedModel, ModelCache

logger = logging.getLogger("alloy.jobs.merge")

Evaluate = Callable[[Path, MergeRequest], dict[str, Any]]
# Runs the job fanned out over several nodes and returns its result, or None to merge here
# (alloy.jobs.merge_fanout.FanoutCoordinator).
Fanout = Callable[[JobRun, MergeRequest, MergeRecipe], "dict[str, Any] | None"]


class MergeJobRunner:
    """Runs one merge job per :meth:`run` call; thread-safe (one call per thread)."""

    def __init__(
        self,
        jobs: JobStore,
        models: ModelRegistry,
        work_dir: Path,
        *,
        cache_bytes: int = 0,
        device: str = "cpu",
        shard_bytes: int | None = None,
        max_in_flight: int | None = None,
        evaluate: Evaluate | None = None,
        heartbeat_s: float = 5.0,
        fanout: Fanout | None = None,
        node: str | None = None,
    ):
        self.jobs = jobs
        self.models = models
        self.work_dir = Path(work_dir)
        self.cache = ModelCache(self._resolve, capacity_bytes=cache_bytes)  # input models kept across jobs
        self.device = device
        self.shard_bytes = shard_bytes
        self.max_in_flight = max_in_flight
        self.evaluate = evaluate
        self.fanout = fanout
        self.node = node  # where this runner coordinates its jobs (recorded in each result)
        self.job_runner = JobRunner(
            jobs, JobKind.MERGE, self._body, heartbeat_s=heartbeat_s, claim_progress={"stage": "preparing"}
        )

    @property
    def running(self) -> dict[str, threading.Event]:
        return self.job_runner.running

    def run(self, job_id: str, cancel: threading.Event | None = None) -> JobRecord:
        """Run job ``job_id`` to its end (never raises for a job-level failure; the job records it)."""
        return self.job_runner.run(job_id, cancel)

    def interrupt_all(self) -> list[str]:
        return self.job_runner.interrupt_all()

    def _resolve(self, model_id: str) -> CachedModel:
        manifest = self.models.manifest(model_id)
        return CachedModel(model_id, Path(self.models.local_dir(model_id)), manifest, int(manifest.size_bytes))

    # -- the body ------------------------------------------------------------------------------------------
    def _body(self, run: JobRun) -> dict[str, Any]:
        out_dir = self.work_dir / f"{run.job_id}-{uuid.uuid4().hex[:8]}"
        run.on_exit(lambda: shutil.rmtree(out_dir, ignore_errors=True))
        request = MergeRequest.model_validate(run.record.request)
        recipe = self._check(request)
        fanned = self.fanout(run, request, recipe) if self.fanout is not None else None
        if fanned is not None:
            return {**fanned, **self._where()}
        sources = self._inputs(recipe)
        run.check_cancel()
        result = self._merge(run, recipe, sources, out_dir)
        evaluation = None
        if request.evaluate is not None and self.evaluate is not None:
            run.transition(JobState.EVALUATING, progress={"stage": "evaluating"})
            evaluation = self.evaluate(out_dir, request)
            run.check_cancel()
        record = self.models.register(
            request.output_model_id,
            str(out_dir),
            lineage={
                "job_id": run.job_id,
                "strategy": recipe.strategy,
                "method": recipe.variant,
                "models": recipe.model_ids,
                "parameters": recipe.parameters,
            },
        )
        run.on_undo(lambda: self._unregister(record.id))
        # Scratch goes before COMPLETED, so that a completed job never leaves anything behind it.
        shutil.rmtree(out_dir, ignore_errors=True)
        return {"model_id": record.id, "evaluation": evaluation, **_summary(result), **self._where()}

    def _where(self) -> dict[str, Any]:
        return {"node": self.node} if self.node else {}

    def _check(self, request: MergeRequest) -> MergeRecipe:
        recipe = request.recipe()
        if self.models.exists(request.output_model_id):
            raise AlloyError(
                ErrorCode.ALREADY_EXISTS,
                f"model {request.output_model_id!r} already exists",
                {"model_id": request.output_model_id},
            )
        return recipe

    def _inputs(self, recipe: MergeRecipe) -> dict[str, Path]:
        resolved = {model_id: self.cache.get(model_id) for model_id in recipe.model_ids}
        check_compatibility(recipe, {model_id: entry.manifest for model_id, entry in resolved.items()})
        return {model_id: entry.local_dir for model_id, entry in resolved.items()}

    def _merge(self, run: JobRun, recipe: MergeRecipe, sources: dict[str, Path], out_dir: Path) -> MergeResult:
        run.transition(JobState.RUNNING, progress={"stage": "merging"})
        reporter = ProgressReporter(self.jobs, run.job_id)
        kwargs: dict[str, Any] = {"device": self.device, "progress": reporter, "cancel": run.cancel}
        if self.shard_bytes:
            kwargs["shard_bytes"] = self.shard_bytes
        if self.max_in_flight:
            kwargs["max_in_flight"] = self.max_in_flight
        try:
            outcome = execute_merge(recipe, sources, out_dir, **kwargs)
        except AlloyError:
            raise
        except Exception:
            if run.cancel.is_set():  # the executor stops with its own exception when cancelled
                raise JobInterrupted() from None
            raise
        run.check_cancel()
        reporter.flush()
        return outcome

    def _unregister(self, model_id: str) -> None:
        try:
            self.models.delete(model_id)
        except AlloyError:
            logger.exception("could not remove %s after a failed job", model_id)


def _summary(outcome: MergeResult) -> dict[str, Any]:
    """The executor's result as the job result's ``merge`` field."""
    return {"merge": outcome.model_dump(mode="json", include={"tensors", "bytes", "seconds"})}


class ProgressReporter:
    """The executor's progress callback -> JobStore, throttled so a fast merge of thousands of tensors does
    not turn into thousands of database writes."""

    def __init__(self, jobs: JobStore, job_id: str, min_interval_s: float = 0.5):
        self.jobs = jobs
        self.job_id = job_id
        self.min_interval_s = min_interval_s
        self.started = time.monotonic()
        self._last_write = 0.0
        self._pending: dict[str, Any] | None = None

    def __call__(self, event: MergeProgress) -> None:
        update: dict[str, Any] = event.model_dump(include=set(PROGRESS_KEYS), exclude_none=True)
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


PROGRESS_KEYS = ("tensors_done", "tensors_total", "bytes_done", "bytes_total")
