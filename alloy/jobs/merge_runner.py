"""The merge job's body, run by the job skeleton (:mod:`alloy.jobs.skeleton`); plain Python, no Ray.

The body re-validates the request (the registry may have changed since the ingress checked it), resolves the
sources through a model cache, merges into a private work folder, optionally evaluates, and registers the
output only as the last step before COMPLETED, so a FAILED job leaves nothing registered and no visible
artifact. Claim, heartbeat, endings, cancel and requeue are the skeleton's.

Scratch: a run works in ``<work_dir>/<job_id>/<attempt>-<random>/`` (the executor stages its output next to
``model/`` there). The folder goes when the run ends; a run that was lost (its replica killed) leaves it, and
:meth:`MergeJobRunner.clean_lost_run` removes it when the job is requeued (every run folder of an older attempt,
so never the folder of a live run of the current attempt), with the staging leftovers of its registration and
an output it registered without completing. A replica's start removes what lost runs left in its work folder.
Before writing, the free disk space is checked against the output size the plan gives (INSUFFICIENT_STORAGE).
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from alloy.errors import AlloyError, ErrorCode
from alloy.jobs.liveness import DEFAULT_HEARTBEAT_S
from alloy.jobs.merge_request import MergeRequest
from alloy.jobs.records import JobKind, JobRecord, JobState
from alloy.jobs.skeleton import JobInterrupted, JobRun, JobRunner
from alloy.jobs.store import JobStore
from alloy.merge.executor import MergeProgress, MergeResult, check_compatibility, execute_merge
from alloy.merge.lora import LoraSource
from alloy.merge.recipe import MergeRecipe
from alloy.registry.adapters import input_manifest, input_source
from alloy.registry.models import ModelRegistry
from alloy.storage.disk_space import SpaceNeed, merge_output_bytes, require_free_space, storage_error
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
        heartbeat_s: float = DEFAULT_HEARTBEAT_S,
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
            jobs,
            JobKind.MERGE,
            self._body,
            heartbeat_s=heartbeat_s,
            claim_progress={"stage": "preparing"},
            clean_lost_run=self.clean_lost_run,
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

    # -- scratch -------------------------------------------------------------------------------------------
    def _run_dir(self, run: JobRun) -> Path:
        return self.work_dir / run.job_id / f"{run.attempt}-{uuid.uuid4().hex[:8]}"

    def _remove_run_dir(self, run_dir: Path) -> None:
        shutil.rmtree(run_dir, ignore_errors=True)
        with contextlib.suppress(OSError):  # the job's folder goes with its last run (another may be starting)
            run_dir.parent.rmdir()

    def clean_lost_run(self, job: JobRecord) -> None:
        """What a lost run of ``job`` (just requeued) left: its run folders (every older attempt's), the staging
        leftovers of its output's registration, an output it registered but never completed."""
        self._remove_old_runs(job)
        output = job.request.get("output_model_id")
        if isinstance(output, str) and output:
            removed = self.models.discard_unfinished(output, job.id)
            if removed:
                logger.warning("merge job %s: removed what its lost run left: %s", job.id, ", ".join(removed))

    def clean_work_dir(self) -> list[str]:
        """A replica's start: remove the run folders of jobs that ended or were requeued since (lost runs)."""
        removed: list[str] = []
        if not self.work_dir.is_dir():
            return removed
        for job_dir in self.work_dir.iterdir():
            if not job_dir.is_dir():
                continue
            try:
                job = self.jobs.get(job_dir.name)
            except AlloyError:
                job = None
            if job is None or job.state.terminal:
                shutil.rmtree(job_dir, ignore_errors=True)
                removed.append(job_dir.name)
            elif self._remove_old_runs(job):
                removed.append(job_dir.name)
        return removed

    def _remove_old_runs(self, job: JobRecord) -> bool:
        job_dir = self.work_dir / job.id
        if not job_dir.is_dir():
            return False
        removed = False
        for run_dir in job_dir.iterdir():
            # A run of the job's current attempt may be alive (it claimed the job before it made its folder); a
            # run of an older attempt lost the job when it was requeued.
            attempt = run_dir.name.split("-", 1)[0]
            if not attempt.isdigit() or int(attempt) < job.attempts:
                shutil.rmtree(run_dir, ignore_errors=True)
                removed = True
        with contextlib.suppress(OSError):
            job_dir.rmdir()
        return removed

    # -- the body ------------------------------------------------------------------------------------------
    def _body(self, run: JobRun) -> dict[str, Any]:
        run_dir = self._run_dir(run)
        out_dir = run_dir / "model"
        run.on_exit(lambda: self._remove_run_dir(run_dir))
        request = MergeRequest.model_validate(run.record.request)
        recipe = self._check(request, run.job_id)
        fanned = self.fanout(run, request, recipe) if self.fanout is not None else None
        if fanned is not None:
            return {**fanned, **self._where()}
        sources = self._inputs(recipe)
        run.check_cancel()
        self._check_space(recipe, sources, run_dir)
        result = self._merge(run, recipe, sources, out_dir)
        evaluation = None
        if request.evaluate is not None and self.evaluate is not None:
            run.transition(JobState.EVALUATING, progress={"stage": "evaluating"})
            evaluation = self.evaluate(out_dir, request)
            run.check_cancel()
        lineage = {
            "job_id": run.job_id,
            "strategy": recipe.strategy,
            "method": recipe.variant,
            "models": recipe.model_ids,
            "parameters": recipe.parameters,
        }
        try:
            record = self.models.register(request.output_model_id, str(out_dir), lineage=lineage)
        except OSError as exc:
            full = storage_error(exc, "the artifact store")
            if full is None:
                raise
            raise full from None
        run.on_undo(lambda: self._unregister(record.id))
        # Scratch goes before COMPLETED, so that a completed job never leaves anything behind it.
        self._remove_run_dir(run_dir)
        return {"model_id": record.id, "evaluation": evaluation, **_summary(result), **self._where()}

    def _where(self) -> dict[str, Any]:
        return {"node": self.node} if self.node else {}

    def _check(self, request: MergeRequest, job_id: str) -> MergeRecipe:
        recipe = request.recipe()
        output = request.output_model_id
        if self.models.exists(output) and self.models.discard_unfinished(output, job_id):
            logger.warning("merge job %s: removed the output an earlier run of it registered", job_id)
        if self.models.exists(output):
            raise AlloyError(
                ErrorCode.ALREADY_EXISTS,
                f"model {request.output_model_id!r} already exists",
                {"model_id": request.output_model_id},
            )
        return recipe

    def _inputs(self, recipe: MergeRecipe) -> dict[str, Path | LoraSource]:
        # a ``base-id+adapter-id`` input: the base and the adapter resolved (and cached) one by one
        entries: dict[str, CachedModel] = {}

        def entry(model_id: str) -> CachedModel:
            if model_id not in entries:
                entries[model_id] = self.cache.get(model_id)
            return entries[model_id]

        manifests = {m: input_manifest(lambda i: entry(i).manifest, m) for m in recipe.model_ids}
        check_compatibility(recipe, manifests)
        return {m: input_source(m, lambda i: entry(i).local_dir) for m in recipe.model_ids}

    def _merge(
        self, run: JobRun, recipe: MergeRecipe, sources: dict[str, Path | LoraSource], out_dir: Path
    ) -> MergeResult:
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
        except Exception as exc:
            if run.cancel.is_set():  # the executor stops with its own exception when cancelled
                raise JobInterrupted() from None
            full = storage_error(exc, "the merge work folder")
            if full is None:
                raise
            raise full from None
        run.check_cancel()
        reporter.flush()
        return outcome

    def _check_space(self, recipe: MergeRecipe, sources: dict[str, Path | LoraSource], run_dir: Path) -> None:
        """INSUFFICIENT_STORAGE before anything is written: the output goes to the work folder, then (when the
        artifact store is a local folder) it is copied into the store."""
        size = merge_output_bytes(recipe, sources)
        needs = [SpaceNeed(run_dir, size, "the merge work folder")]
        store = self.models.store
        if store.is_local:
            needs.append(SpaceNeed(Path(store.root), size, "the artifact store"))
        require_free_space(needs)

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
