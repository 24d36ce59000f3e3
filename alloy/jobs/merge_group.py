"""One group of a fanned-out merge, as it runs on whichever node it was placed on (plain Python, no Ray: the Ray
task around it is :mod:`alloy.control.merge_fanout`).

The group resolves the inputs through this node's registry cache (``<data_dir>/cache/models``: a verified
download from the artifact store the first time a node needs a model, the folder itself for a local store),
merges only its shards with the streaming executor, and uploads each finished shard straight into the
artifact store's staging area under the merge's staging id (hidden until the coordinator publishes the whole
folder). Its scratch folder is removed whatever happens.
"""

from __future__ import annotations

import shutil
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from alloy.config import Settings
from alloy.errors import AlloyError, ErrorCode
from alloy.merge.executor import MergeProgress, execute_merge
from alloy.merge.fanout import GroupFile, GroupProgress, GroupResult, GroupSpec
from alloy.merge.recipe import MergeRecipe
from alloy.model_manifest import read_safetensors_header
from alloy.registry.models import ModelRegistry
from alloy.storage.artifacts import ArtifactStore
from alloy.storage.db import Database

PROGRESS_EVERY_S = 0.5
# Failures that would fail again on any node (the recipe, the inputs): the job fails at once, no retry.
DETERMINISTIC_CODES = frozenset(
    {
        ErrorCode.VALIDATION_FAILED,
        ErrorCode.INVALID_STRATEGY,
        ErrorCode.INCOMPATIBLE_MODELS,
        ErrorCode.MODEL_NOT_FOUND,
        ErrorCode.ALREADY_EXISTS,
        ErrorCode.GPU_UNAVAILABLE,
    }
)


@dataclass
class GroupServices:
    """What a group needs on its node: the registry (this node's model cache), the artifact store, scratch."""

    models: ModelRegistry
    store: ArtifactStore
    work_dir: Path
    device: str
    max_in_flight: int


_opened: dict[str, GroupServices] = {}
_opening = threading.Lock()


def group_services(settings: Settings) -> GroupServices:
    """One set per process and settings (a Ray worker runs many groups): the database pool is kept."""
    key = settings.model_dump_json()
    with _opening:
        if key not in _opened:
            db = Database.from_settings(settings)
            store = ArtifactStore.from_settings(settings)
            _opened[key] = GroupServices(
                ModelRegistry.from_settings(settings, db, store),
                store,
                settings.merge_work_dir,
                settings.merge.device,
                settings.merge.max_in_flight,
            )
        return _opened[key]


def local_inputs(models: ModelRegistry, model_ids: list[str]) -> dict[str, Path]:
    """Each input's folder on this node. Several groups on one node may want the same model at once: the
    registry serialises its download per model and node, so one downloads and the others find it complete."""
    return {model_id: Path(models.local_dir(model_id)) for model_id in model_ids}


def run_group(
    services: GroupServices,
    spec: GroupSpec,
    recipe: MergeRecipe,
    *,
    progress: Callable[[GroupProgress], None] | None = None,
    cancel: threading.Event | None = None,
) -> GroupResult:
    """Merge the group's shards and stage them in the artifact store; returns their files and headers."""
    started = time.perf_counter()
    for stale in services.work_dir.glob(f"*{spec.job_id}-g{spec.index}-*"):  # an earlier attempt killed here
        shutil.rmtree(stale, ignore_errors=True)
    sources = local_inputs(services.models, recipe.model_ids)
    fetched = time.perf_counter()
    out_dir = services.work_dir / f"{spec.job_id}-g{spec.index}-{uuid.uuid4().hex[:8]}"
    throttle = _Throttle(spec.index, progress)
    try:
        result = execute_merge(
            recipe,
            sources,
            out_dir,
            device=services.device,
            progress=throttle,
            cancel=cancel,
            shard_bytes=spec.shard_bytes,
            max_in_flight=services.max_in_flight,
            shards=spec.shards,
        )
        throttle.flush()
        merged = time.perf_counter()
        files, headers = [], {}
        for path in sorted(out_dir.glob("*.safetensors")):
            headers[path.name] = read_safetensors_header(path)
            files.append(GroupFile(**services.store.stage_file(spec.staging_id, path.name, path)))
            path.unlink()  # the node's scratch holds at most the shards not uploaded yet
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    expected = len(spec.shards)
    if len(files) != expected:
        raise AlloyError(ErrorCode.INTERNAL_ERROR, f"group {spec.index} wrote {len(files)} of {expected} shards")
    return GroupResult(
        index=spec.index,
        files=files,
        headers=headers,
        tensors=result.tensors,
        bytes=result.bytes,
        seconds=time.perf_counter() - started,
        fetch_s=fetched - started,
        upload_s=time.perf_counter() - merged,
        attempt=spec.attempt,
    )


class _Throttle:
    """The executor's per-tensor progress as a group's, at most every PROGRESS_EVERY_S."""

    def __init__(self, index: int, sink: Callable[[GroupProgress], None] | None):
        self.index, self.sink = index, sink
        self.last = 0.0
        self.pending: GroupProgress | None = None

    def __call__(self, event: MergeProgress) -> None:
        self.pending = GroupProgress(index=self.index, tensors_done=event.tensors_done, bytes_done=event.bytes_done)
        if time.monotonic() - self.last >= PROGRESS_EVERY_S:
            self.flush()

    def flush(self) -> None:
        if self.sink is not None and self.pending is not None:
            self.sink(self.pending)
            self.last, self.pending = time.monotonic(), None
