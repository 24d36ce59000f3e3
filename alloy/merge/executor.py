"""The streaming merge executor.

Tensors are read lazily (``pread``, no memory map), merged by a small thread pool with a bounded number of tensors
and working bytes in flight (:func:`alloy.merge.footprint.working_bytes`: inputs plus the kernel's temporaries,
so that the peak resident set is the process's base plus the budget, or plus the one task larger than it), and
written straight into preallocated shards. A large tensor of an elementwise method is streamed instead
(:mod:`alloy.merge.streamed`): read, merged and written a piece at a time, so that it costs the budget a piece.
The merged folder is assembled in a hidden staging sibling of ``out_dir`` and renamed into place only when
complete: a failure or a cancel leaves nothing at ``out_dir`` and no staging folder behind.
"""

from __future__ import annotations

import dataclasses
import functools
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Collection, Mapping
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict

from alloy.errors import AlloyError, ErrorCode, model_not_found
from alloy.merge.allocator import fix_mmap_threshold
from alloy.merge.compatibility import check_compatibility, check_layouts
from alloy.merge.footprint import execution_order, merge_lanes, runs_alone, usable_cores, working_bytes
from alloy.merge.lora import LoraSource, TensorReader, model_folder, open_readers
from alloy.merge.output_files import copy_base_files, write_config, write_model_card, write_recipe_files
from alloy.merge.plan import MergePlan, TensorTask, build_plan, layout_from_manifest, layout_from_state_dict
from alloy.merge.recipe import MergeRecipe, validate_recipe
from alloy.merge.recipe_checks import ignored_warnings
from alloy.merge.streamed import can_read_pieces, merge_streamed, streams
from alloy.merge.tensor_io import PlannedTensor, ShardedWriter
from alloy.merge.tensor_merge import compute_tensor
from alloy.merge.tokenizer_merge import prepare_tokenizer
from alloy.merge.tokenizer_rows import RowPlanner
from alloy.model_manifest import ModelManifest, read_manifest

__all__ = [
    "MergeCancelled",
    "MergeProgress",
    "MergeResult",
    "check_compatibility",
    "execute_merge",
    "merge_state_dicts",
    "output_tensors",
]

DEFAULT_SHARD_BYTES = 2 * 1024**3
DEFAULT_MAX_IN_FLIGHT = 4
DEFAULT_MAX_IN_FLIGHT_BYTES = 512 * 1024**2  # working bytes (footprint.working_bytes) of the tasks in flight
DEFAULT_WORKERS = 2
CANCEL_POLL_S = 0.1


class MergeCancelled(RuntimeError):
    """Raised by :func:`execute_merge` when its ``cancel`` event is set; nothing was published."""

    def __init__(self, out_dir: Path):
        super().__init__(f"merge into {out_dir} was cancelled; nothing was written there")
        self.out_dir = out_dir


class MergeProgress(BaseModel):
    tensors_done: int
    tensors_total: int
    bytes_done: int
    bytes_total: int
    current: str | None  # the tensor just finished

    @property
    def fraction(self) -> float:
        return self.bytes_done / self.bytes_total if self.bytes_total else 1.0


class MergeResult(BaseModel):
    model_config = ConfigDict(arbitrary_types_allowed=True)

    out_dir: Path
    tensors: int
    bytes: int
    seconds: float
    manifest: ModelManifest | None  # None for a group of shards (``shards=``): no config.json of its own
    warnings: list[str] = []  # what the recipe said that the merge did not use (see ignored_warnings)


def resolve_device(device: str | None) -> str:
    device = device or "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise AlloyError(
            ErrorCode.GPU_UNAVAILABLE,
            f"device {device!r} requested but no CUDA device is available",
            {"device": device},
        )
    if not (device == "cpu" or device.startswith("cuda")):
        raise AlloyError(
            ErrorCode.VALIDATION_FAILED, f"unknown device {device!r} (cpu, cuda, cuda:N)", {"field": "device"}
        )
    return device


def prepare(recipe: MergeRecipe, manifests: Mapping[str, ModelManifest], rows: RowPlanner | None = None) -> MergePlan:
    """Validate the recipe, check compatibility from the manifests and plan the output tensors (``rows``: the
    embedding rows' alignment to an output vocabulary)."""
    recipe = validate_recipe(recipe)
    check_compatibility(recipe, manifests)
    return build_plan(recipe, {m: layout_from_manifest(manifests[m]) for m in recipe.model_ids}, rows)


def execute_merge(
    recipe: MergeRecipe,
    sources: Mapping[str, Path | LoraSource],
    out_dir: Path,
    *,
    device: str = "cpu",
    progress: Callable[[MergeProgress], None] | None = None,
    cancel: threading.Event | None = None,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
    max_in_flight_bytes: int = DEFAULT_MAX_IN_FLIGHT_BYTES,
    workers: int = DEFAULT_WORKERS,
    shards: Collection[int] | None = None,
) -> MergeResult:
    """Merge the models in ``sources`` (model id -> local folder, or base and adapter folders for a
    ``base+adapter`` model id) into the new folder ``out_dir``.

    ``shards``: one group of a fanned-out merge (:mod:`alloy.merge.fanout`): only the output shards with these
    numbers (from 1, in the layout ``shard_bytes`` gives the whole merge) are computed and written, byte for byte
    as the whole merge writes them, and nothing else (no index, config or card: the coordinator's)."""
    started = time.perf_counter()
    out_dir = Path(out_dir)
    if out_dir.exists():
        raise AlloyError(ErrorCode.ALREADY_EXISTS, f"{out_dir} already exists", {"path": str(out_dir)})
    device = resolve_device(device)
    for model_id in recipe.model_ids:
        if model_id not in sources:
            raise model_not_found(model_id)
    manifests = {m: read_manifest(model_folder(sources[m])) for m in recipe.model_ids}
    tokenizer = prepare_tokenizer(recipe, {m: model_folder(source) for m, source in sources.items()})
    plan = prepare(recipe, manifests, tokenizer.rows if tokenizer else None)

    fix_mmap_threshold()
    readers = open_readers(list(plan.model_ids), sources, manifests)  # adapters are checked here, before any write
    staging = out_dir.parent / f".{out_dir.name}.staging-{uuid.uuid4().hex[:12]}"
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        staging.mkdir()
        writer = ShardedWriter(
            staging,
            output_tensors(plan),
            shard_bytes,
            metadata={"merged_by": "alloy", "strategy": plan.recipe.strategy, "method": plan.method.name},
            only=shards,
        )
        if shards is not None:
            plan = dataclasses.replace(plan, tasks=tuple(t for t in plan.tasks if t.output_name in writer.slots))
        try:
            _run_tasks(
                plan,
                readers,
                writer,
                device=device,
                progress=progress,
                cancel=cancel,
                max_in_flight=max_in_flight,
                max_in_flight_bytes=max_in_flight_bytes,
                workers=workers,
                out_dir=out_dir,
            )
            writer.finish(index=shards is None)
        finally:
            writer.close()
        if shards is None:
            base_dir = model_folder(sources[plan.base_id])
            write_config(plan, base_dir, staging, tokenizer)
            copy_base_files(base_dir, staging, with_tokenizer=tokenizer is None)
            if tokenizer is not None:
                tokenizer.write(staging)
            write_model_card(plan, staging)
            write_recipe_files(plan, staging)
        if out_dir.exists():
            raise AlloyError(ErrorCode.ALREADY_EXISTS, f"{out_dir} appeared during the merge", {"path": str(out_dir)})
        staging.rename(out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    finally:
        for reader in readers.values():
            reader.close()
    return MergeResult(
        out_dir=out_dir,
        tensors=len(plan.tasks),
        bytes=writer.total_bytes,
        seconds=time.perf_counter() - started,
        manifest=read_manifest(out_dir) if shards is None else None,
        warnings=ignored_warnings(plan.recipe),
    )


def output_tensors(plan: MergePlan) -> list[PlannedTensor]:
    """The output tensors in plan order: what the shard layout is cut from (the whole merge and its groups)."""
    return [PlannedTensor(t.output_name, t.dtype, t.shape) for t in plan.tasks]


def _run_tasks(
    plan: MergePlan,
    readers: Mapping[str, TensorReader],
    writer: ShardedWriter,
    *,
    device: str,
    progress,
    cancel,
    max_in_flight: int,
    max_in_flight_bytes: int,
    workers: int,
    out_dir: Path,
) -> None:
    """Submit tasks in :func:`alloy.merge.footprint.execution_order` while fewer than ``max_in_flight`` tasks and
    ``max_in_flight_bytes`` working bytes are in flight (a task larger than the byte budget runs alone); report
    each completion in order of completion from this thread. :func:`alloy.merge.footprint.replay_schedule` replays this rule: keep them
    in step."""
    total = len(plan.tasks)
    done = 0
    bytes_done = 0
    in_flight: dict[Future, int] = {}
    budget_used = 0
    stop = threading.Event()

    def work(task: TensorTask, io: ThreadPoolExecutor | None = None) -> int:
        if stop.is_set():
            return 0
        if device == "cpu" and streams(plan, task) and can_read_pieces(readers, task):
            return merge_streamed(plan, task, readers, writer)
        sources = [functools.partial(readers[model].read, name) for model, name in task.sources]
        inputs = [read() for read in sources] if io is None else list(io.map(lambda read: read(), sources))
        out = compute_tensor(plan, task, inputs, device=device, owned=True)
        del inputs
        if io is None:
            return writer.write(task.output_name, out)
        return writer.write_split(task.output_name, out, io, lanes)

    def work_alone(task: TensorTask) -> int:
        """A task over the budget runs alone (the submit loop waited for the others): it takes every merge thread's
        cores. WHY: the largest tensors (the embeddings) ran alone on one core while the other idled: TIES over
        4 x 1.35 GB models spent 4.9 of its 11.5 s there. Its reads and writes go on threads (a system call holds no
        GIL) and its torch ops on more intra-op threads: its pieces are above torch's grain (kernels.pieces). Not
        Python threads for the kernel: its ops are short, and two threads handing the GIL to each other per op
        were slower than one (measured: a top-k cut on 2 threads 216 ms of wall and 337 CPU ms, on 1 thread 257)."""
        previous = torch.get_num_threads()
        torch.set_num_threads(max(previous, min(previous * lanes, cores)))
        try:
            with ThreadPoolExecutor(max_workers=lanes, thread_name_prefix="alloy-io") as io:
                return work(task, io)
        finally:
            torch.set_num_threads(previous)

    def collect(block_until_one: bool) -> None:
        nonlocal done, bytes_done, budget_used
        while True:
            if cancel is not None and cancel.is_set():
                raise MergeCancelled(out_dir)
            finished, _ = wait(
                list(in_flight), timeout=CANCEL_POLL_S if block_until_one else 0, return_when=FIRST_COMPLETED
            )
            for future in finished:
                cost = in_flight.pop(future)
                budget_used -= cost
                written = future.result()  # re-raises a worker's failure
                done += 1
                bytes_done += written
                if progress is not None:
                    progress(
                        MergeProgress(
                            tensors_done=done,
                            tensors_total=total,
                            bytes_done=bytes_done,
                            bytes_total=writer.total_bytes,
                            current=tasks_by_future.pop(future),
                        )
                    )
            if finished or not block_until_one:
                return

    tasks_by_future: dict[Future, str] = {}
    pool = ThreadPoolExecutor(max_workers=max(1, min(workers, max_in_flight)), thread_name_prefix="alloy-merge")
    cores = usable_cores()
    lanes = merge_lanes(workers, max_in_flight, cores) if device == "cpu" else 1
    try:
        for task in execution_order(plan.tasks):
            cost = min(working_bytes(plan, task, streamed=device == "cpu"), max_in_flight_bytes)
            while in_flight and (len(in_flight) >= max_in_flight or budget_used + cost > max_in_flight_bytes):
                collect(block_until_one=True)
            if cancel is not None and cancel.is_set():
                raise MergeCancelled(out_dir)
            # over the budget: it runs alone (the loop above waited for the others), on every merge thread's cores
            alone = lanes > 1 and runs_alone(plan, task, max_in_flight_bytes, streamed=device == "cpu")
            future = pool.submit(work_alone if alone else work, task)
            in_flight[future] = cost
            tasks_by_future[future] = task.output_name
            budget_used += cost
        while in_flight:
            collect(block_until_one=True)
    except BaseException:
        stop.set()
        for future in in_flight:
            future.cancel()
        raise
    finally:
        pool.shutdown(wait=True)


def merge_state_dicts(
    recipe: MergeRecipe, state_dicts: Mapping[str, Mapping[str, torch.Tensor]], *, device: str = "cpu"
) -> dict[str, torch.Tensor]:
    """The same merge fully in memory (evolution's candidates): bit-identical to :func:`execute_merge` for the
    same recipe and seed. Inputs are not modified."""
    device = resolve_device(device)
    recipe = validate_recipe(recipe)
    if recipe.tokenizer is not None and recipe.tokenizer.builds_vocabulary:
        raise AlloyError(
            ErrorCode.VALIDATION_FAILED,
            "tokenizer merging reads the models' tokenizer files: merge folders (execute_merge), not state dicts",
            {"field": "tokenizer"},
        )
    for model_id in recipe.model_ids:
        if model_id not in state_dicts:
            raise model_not_found(model_id)
    layouts = {m: layout_from_state_dict(state_dicts[m]) for m in recipe.model_ids}
    check_layouts(recipe, layouts)
    plan = build_plan(recipe, layouts)
    merged: dict[str, torch.Tensor] = {}
    for task in plan.tasks:
        inputs = [state_dicts[model][name] for model, name in task.sources]
        out = compute_tensor(plan, task, inputs, device=device, owned=False)
        # A copy task may return the caller's own tensor; hand back storage the caller does not share.
        merged[task.output_name] = out.clone() if any(out is t for t in inputs) else out
    return merged
