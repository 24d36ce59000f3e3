"""A fanned-out merge job, the coordinator's side (plain Python, no Ray): what the MergeEngine replica that
claimed the job does instead of merging in its own process.

1. **Decide** (:func:`fanout_groups`): the request's ``parallelism``, else ``merge.fanout_groups``
   when the output is at least ``merge.fanout_threshold_bytes`` (never with ``evaluate``: the output is never
   on one node); a merge whose output has a single shard runs in one process.
2. **Plan** from the registry's manifests only (nothing is downloaded here), cut the output into shards exactly
   as the single-process merge does and the shards into groups (:mod:`alloy.merge.fanout`).
3. **Run** every group through the injected :class:`GroupLauncher` (Ray tasks on any node:
   :mod:`alloy.control.merge_fanout`); their progress is summed into the job's (tensors, bytes). A group that
   fails for a reason another attempt may not meet (a node lost, a worker killed, an I/O error) is launched
   again, at most ``retries`` times; one that fails deterministically (the recipe, the inputs) fails the job.
4. **Publish** once every group succeeded: the index, config, model card and the base's tokenizer files are
   staged next to the groups' shards, the folder is published at ``models/<id>`` in one atomic step and
   registered with the manifest read from the shards' headers. Only then is the job COMPLETED.

A cancel (the replica shutting down) cancels the groups, discards the staging and requeues the job, as a
single-process merge is requeued; a coordinator killed outright leaves only hidden staging objects (removed
by the recovery of the next start, or by ``gc_staging``) and its requeued job starts over. Either way no
partial model is ever visible.
"""

from __future__ import annotations

import queue
import shutil
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from pydantic import BaseModel

from alloy.config import MergeSettings
from alloy.errors import AlloyError, ErrorCode
from alloy.jobs.merge_request import MergeRequest
from alloy.jobs.merge_runner import ProgressReporter
from alloy.jobs.records import JobState
from alloy.jobs.skeleton import JobInterrupted, JobRun
from alloy.merge.executor import MergeProgress, prepare
from alloy.merge.fanout import GroupProgress, GroupResult, GroupSpec, ShardLayout, shard_layout, split_groups
from alloy.merge.output_files import copy_base_files, write_config, write_model_card, write_recipe_files
from alloy.merge.plan import MergePlan
from alloy.merge.recipe import MergeRecipe
from alloy.merge.tensor_io import INDEX_FILE
from alloy.model_manifest import manifest_from_headers
from alloy.registry.models import MODELS_PREFIX, ModelRegistry

POLL_S = 0.2
GROUP_SUMMARY = {"index", "node", "attempt", "tensors", "bytes", "seconds", "fetch_s", "upload_s"}
DEFAULT_RETRIES = 2


class GroupFailure(BaseModel):
    """How a group ended when it did not succeed (what the launcher reports instead of a result)."""

    index: int
    code: ErrorCode
    message: str
    retryable: bool


GroupEvent = GroupProgress | GroupResult | GroupFailure


class GroupLauncher(Protocol):
    def launch(self, spec: GroupSpec, recipe: MergeRecipe, report: Callable[[GroupEvent], None]) -> Callable[[], None]:
        """Start one group; ``report`` gets its progress events (any thread), then exactly one GroupResult or
        GroupFailure. Returns a function that cancels it."""
        ...


def fanout_groups(request: MergeRequest, layout: ShardLayout, settings: MergeSettings) -> int | None:
    """How many groups the merge is fanned out over, or None: it runs in one process."""
    if len(layout.shards) < 2:
        return None
    if request.parallelism is not None:
        return request.parallelism if request.parallelism > 1 else None
    threshold = settings.fanout_threshold_bytes
    if request.evaluate is None and threshold is not None and layout.total_bytes >= threshold:
        return settings.fanout_groups
    return None


class FanoutCoordinator:
    def __init__(
        self,
        models: ModelRegistry,
        launcher: GroupLauncher,
        settings: MergeSettings,
        work_dir: Path,
        *,
        retries: int = DEFAULT_RETRIES,
    ):
        self.models, self.store = models, models.store
        self.launcher = launcher
        self.settings = settings
        self.work_dir = Path(work_dir)
        self.retries = retries

    # -- the hook of MergeJobRunner ------------------------------------------------------------------------
    def __call__(self, run: JobRun, request: MergeRequest, recipe: MergeRecipe) -> dict[str, Any] | None:
        """Run the job fanned out and return its result, or None: the single-process merge runs it."""
        if recipe.tokenizer is not None or any("+" in model_id for model_id in recipe.model_ids):
            # A merged vocabulary needs every input's tokenizer on the coordinator, and a LoRA input its adapter
            # folded in by every group: both run in one process (bit-identical outputs either way).
            return None
        manifests = {model_id: self.models.manifest(model_id) for model_id in recipe.model_ids}
        plan = prepare(recipe, manifests)
        layout = shard_layout(plan, self.settings.shard_bytes)
        groups = fanout_groups(request, layout, self.settings)
        if groups is None:
            return None
        return self.run(run, request, plan, layout, split_groups(layout, groups))

    # -- running the groups --------------------------------------------------------------------------------
    def run(
        self, run: JobRun, request: MergeRequest, plan: MergePlan, layout: ShardLayout, runs: list[tuple[int, ...]]
    ) -> dict[str, Any]:
        started = time.perf_counter()
        staging_id = self.store.new_staging()
        run.on_exit(lambda: self.store.discard_staged(staging_id))  # a published folder took its files already
        specs = [
            GroupSpec(
                job_id=run.job_id,
                index=i,
                shards=list(shards),
                shard_bytes=self.settings.shard_bytes,
                staging_id=staging_id,
            )
            for i, shards in enumerate(runs)
        ]
        run.transition(JobState.RUNNING, progress={"stage": "merging", "groups": len(specs)})
        results = _GroupRuns(self.launcher, plan.recipe, self.retries).run(
            specs, run, _Progress(ProgressReporter(run.jobs, run.job_id), layout)
        )
        run.check_cancel()
        grouped = time.perf_counter()
        record = self._publish(run, request, plan, layout, staging_id, results)
        return {
            "model_id": record.id,
            "evaluation": None,
            "merge": {
                "tensors": layout.tensor_count,
                "bytes": layout.total_bytes,
                "seconds": time.perf_counter() - started,
                "groups_s": grouped - started,  # launch to the last group's result
                "publish_s": time.perf_counter() - grouped,  # index, config, card, publish, register
                "groups": [r.model_dump(include=GROUP_SUMMARY) for r in results],
                "shards": len(layout.shards),
            },
        }

    # -- publishing ----------------------------------------------------------------------------------------
    def _publish(
        self,
        run: JobRun,
        request: MergeRequest,
        plan: MergePlan,
        layout: ShardLayout,
        staging_id: str,
        results: list[GroupResult],
    ) -> Any:
        headers = {name: h for result in results for name, h in result.headers.items()}
        missing = [s.name for s in layout.shards if s.name not in headers]
        if missing:
            raise AlloyError(ErrorCode.INTERNAL_ERROR, f"fanned-out merge lost shards {missing[:3]}")
        entries = [f.model_dump() for result in results for f in result.files]
        meta = self.work_dir / f"{run.job_id}-meta-{uuid.uuid4().hex[:8]}"
        run.on_exit(lambda: shutil.rmtree(meta, ignore_errors=True))
        config = self._write_meta(plan, layout, meta)
        entries += [self.store.stage_file(staging_id, p.name, p) for p in sorted(meta.iterdir()) if p.is_file()]
        manifest = manifest_from_headers(config, {s.name: headers[s.name] for s in layout.shards})
        run.check_cancel()
        model_id = request.output_model_id
        prefix = f"{MODELS_PREFIX}/{model_id}"
        # Never over a published folder: a lost run's leftover was removed when the job began
        # (ModelRegistry.discard_unfinished), and the output id is this job's claim.
        infos = self.store.publish_staged(staging_id, prefix, entries)
        run.on_undo(lambda: self._forget(model_id, prefix))
        self.models.catalog.record(infos, kind="model")
        return self.models.register(
            model_id,
            self.store.uri_for(prefix),
            manifest=manifest,
            lineage={
                "job_id": run.job_id,
                "strategy": plan.recipe.strategy,
                "method": plan.recipe.variant,
                "models": plan.recipe.model_ids,
                "parameters": plan.recipe.parameters,
            },
        )

    def _write_meta(self, plan: MergePlan, layout: ShardLayout, meta: Path) -> dict[str, Any]:
        """Everything but the weights, as the single-process merge writes it: config, index, card, recipe files
        and the base's tokenizer files (only those are fetched, never the base's weights)."""
        meta.mkdir(parents=True)
        base_dir = self._base_files(plan.base_id, meta.with_name(meta.name + "-base"))
        try:
            config = write_config(plan, base_dir, meta)
            copy_base_files(base_dir, meta)
        finally:
            shutil.rmtree(meta.with_name(meta.name + "-base"), ignore_errors=True)
        write_model_card(plan, meta)
        write_recipe_files(plan, meta)
        (meta / INDEX_FILE).write_text(layout.index_text())
        return config

    def _base_files(self, base_id: str, scratch: Path) -> Path:
        record = self.models.get(base_id)
        if record.source_path is not None or self.store.local_path(record.artifact_prefix or "") is not None:
            return Path(self.models.local_dir(base_id))  # on this machine's disk already: nothing to fetch
        assert record.artifact_prefix is not None
        return self.store.get_dir(
            record.artifact_prefix, scratch, include=lambda name: not name.endswith(".safetensors")
        )

    def _forget(self, model_id: str, prefix: str) -> None:
        if self.models.exists(model_id):
            self.models.delete(model_id)  # the registered folder goes with the record
        else:
            self.store.delete_prefix(prefix)
        self.models.catalog.forget_prefix(prefix)


class _Progress:
    """The groups' latest progress, summed into the job's (through the single-process merge's reporter)."""

    def __init__(self, reporter: ProgressReporter, layout: ShardLayout):
        self.reporter, self.layout = reporter, layout
        self.latest: dict[int, GroupProgress] = {}

    def __call__(self, event: GroupProgress) -> None:
        self.latest[event.index] = event
        self.reporter(
            MergeProgress(
                tensors_done=sum(p.tensors_done for p in self.latest.values()),
                tensors_total=self.layout.tensor_count,
                bytes_done=sum(p.bytes_done for p in self.latest.values()),
                bytes_total=self.layout.total_bytes,
                current=None,
            )
        )

    def restart(self, index: int) -> None:
        """A group launched again starts from zero."""
        self.latest.pop(index, None)


class _GroupRuns:
    """Launch every group, collect their events on one queue, relaunch retryable failures (bounded)."""

    def __init__(self, launcher: GroupLauncher, recipe: MergeRecipe, retries: int):
        self.launcher, self.recipe, self.retries = launcher, recipe, retries
        self.events: queue.Queue[GroupEvent] = queue.Queue()
        self.cancels: dict[int, Callable[[], None]] = {}

    def run(self, specs: list[GroupSpec], run: JobRun, progress: _Progress) -> list[GroupResult]:
        results: dict[int, GroupResult] = {}
        by_index = {spec.index: spec for spec in specs}
        try:
            for spec in specs:
                self._launch(spec)
            while len(results) < len(specs):
                if run.cancel.is_set():
                    raise JobInterrupted()
                try:
                    event = self.events.get(timeout=POLL_S)
                except queue.Empty:
                    continue
                if isinstance(event, GroupProgress):
                    if event.index not in results:
                        progress(event)
                elif isinstance(event, GroupResult):
                    results[event.index] = event
                    progress(GroupProgress(index=event.index, tensors_done=event.tensors, bytes_done=event.bytes))
                else:
                    spec = by_index[event.index]
                    if not event.retryable or spec.attempt >= self.retries:
                        raise AlloyError(
                            event.code,
                            f"merge group {event.index} failed after {spec.attempt + 1} attempt(s): {event.message}",
                            {"group": event.index, "attempts": spec.attempt + 1},
                        )
                    by_index[event.index] = spec = spec.model_copy(update={"attempt": spec.attempt + 1})
                    progress.restart(event.index)
                    self._launch(spec)
        except BaseException:
            for cancel in self.cancels.values():
                cancel()
            raise
        return [results[i] for i in sorted(results)]

    def _launch(self, spec: GroupSpec) -> None:
        self.cancels[spec.index] = self.launcher.launch(spec, self.recipe, self.events.put)
