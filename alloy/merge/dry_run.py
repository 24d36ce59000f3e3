"""The pre-flight dry run: what a merge would do and cost, from the models' headers alone (no weight is read, nothing
is written). ``alloy merge --dry-run`` and ``POST /merge/execute`` with ``"dry_run": true`` answer with it.

The plan is the executor's own (:func:`alloy.merge.executor.prepare`), the shard layout the writer's
(:func:`alloy.merge.tensor_io.split_into_shards`) and the estimates the executor's schedule replayed
(:mod:`alloy.merge.footprint`): nothing here is a second planner.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, Field

from alloy.errors import AlloyError, ErrorCode
from alloy.merge.footprint import merge_lanes, present_load, replay_schedule, usable_cores
from alloy.merge.plan import MergePlan, count_layers
from alloy.merge.recipe import MergeRecipe
from alloy.merge.speed import kernel_ns_per_input_element, probe_task, slowness
from alloy.merge.tensor_io import shard_name, split_into_shards
from alloy.merge.tensor_merge import resolve_task_parameters
from alloy.merge.threads import intra_op_threads
from alloy.model_manifest import ModelManifest

MAX_DISTINCT_SHOWN = 8  # per parameter: the distinct values listed before only the range is given


class ParameterSummary(BaseModel):
    """One parameter's values over every merged tensor (and, for a per-input parameter, every input)."""

    name: str
    scope: str = Field(description="shared (one value per tensor) or per_input")
    min: float
    max: float
    distinct: int = Field(description="how many distinct values the tensors get")
    values: list[float] | None = Field(None, description=f"the distinct values, when at most {MAX_DISTINCT_SHOWN}")


class ShardPlanView(BaseModel):
    file: str
    tensors: int
    bytes: int


class DryRunEstimates(BaseModel):
    peak_memory_bytes: int = Field(description="the merge process's peak resident set")
    disk_bytes: int = Field(description="bytes written: the output shards")
    wall_seconds: float
    cpu_seconds: float
    memory_budget_bytes: int = Field(description="working bytes the executor lets be in flight")
    largest_tensor_bytes: int = Field(description="working bytes of the largest task (runs alone when over budget)")
    machine_slowness: float = Field(
        description="this machine's CPU seconds per second of the machine the time constants were calibrated on "
        "(a probe of memory-bound merge passes, alloy.merge.speed); the reading and writing time is scaled by it"
    )
    kernel_ns_per_element: float = Field(
        description="the method's kernel on this machine, CPU nanoseconds per input element: timed by the dry run "
        "on synthetic inputs shaped like the plan's largest merged tensor, with its parameters"
    )
    basis: str = Field(description="where the figures come from")


class CompatibilityVerdict(BaseModel):
    compatible: bool
    code: str | None = None
    message: str | None = None
    details: dict[str, Any] = Field(default_factory=dict)


class DryRunReport(BaseModel):
    """The resolved plan of a merge, its compatibility verdict and its estimated cost. With ``compatible: false``
    the plan fields are empty (the models cannot be merged as the recipe says)."""

    method: str
    models: list[str]
    base_model: str | None
    compatibility: CompatibilityVerdict
    tensors: int = 0
    computed_tensors: int = Field(0, description="tensors the method merges (the others are copied)")
    input_bytes: int = Field(0, description="bytes of the inputs the merge reads")
    output_layers: int | None = None
    output_dtype: str | None = None
    parameters: list[ParameterSummary] = Field(default_factory=list)
    shards: list[ShardPlanView] = Field(default_factory=list)
    estimates: DryRunEstimates | None = None


def dry_run(
    recipe: MergeRecipe,
    manifests: Mapping[str, ModelManifest],
    *,
    shard_bytes: int,
    workers: int,
    max_in_flight: int,
    budget_bytes: int,
    cpus: int | None = None,
    load: float | None = None,
    threads: int = 0,
    startup_s: float | None = None,
) -> DryRunReport:
    """The report for ``recipe`` over models described by ``manifests``. INCOMPATIBLE_MODELS is the verdict,
    not an error; every other refusal (VALIDATION_FAILED, INVALID_STRATEGY...) is raised as the merge would.
    ``threads``: the torch threads of each merge thread (0: the method's default, :mod:`alloy.merge.threads`);
    ``startup_s``: the merge's start before it plans, when the caller knows it (the CLI: its own process start so
    far; a warm merge engine: 0), to which the dry run adds its own planning time, the merge's next step; None: the
    calibrated STARTUP_S of a fresh process."""
    from alloy.merge.executor import output_tensors, prepare  # the executor imports this module's neighbours

    planning = time.perf_counter()
    try:
        plan = prepare(recipe, manifests)
    except AlloyError as exc:
        if exc.code != ErrorCode.INCOMPATIBLE_MODELS:
            raise
        verdict = CompatibilityVerdict(compatible=False, code=exc.code.value, message=exc.message, details=exc.details)
        return DryRunReport(
            method=recipe.variant or recipe.strategy,
            models=list(recipe.model_ids),
            base_model=recipe.base,
            compatibility=verdict,
        )
    planned_s = time.perf_counter() - planning
    layout = split_into_shards(output_tensors(plan), shard_bytes)
    shards = [
        ShardPlanView(file=shard_name(n, len(layout)), tensors=len(members), bytes=sum(t.nbytes for t in members))
        for n, members in enumerate(layout, start=1)
    ]
    speed = slowness()
    cpus = cpus if cpus is not None else usable_cores()
    threads = threads or intra_op_threads(plan.method, cpus, workers)
    sample = probe_task(plan)
    lanes = merge_lanes(workers, max_in_flight, cpus)
    kernel_ns = kernel_ns_per_input_element(plan, sample, threads, lanes) if sample is not None else 0.0
    schedule = replay_schedule(
        plan,
        plan.tasks,
        workers=workers,
        max_in_flight=max_in_flight,
        budget_bytes=budget_bytes,
        cpus=cpus,
        load=load if load is not None else present_load(),  # sampled once: 0.4 s of readings
        slowness=speed,
        kernel_ns=kernel_ns,
        startup_s=None if startup_s is None else startup_s + planned_s,
    )
    disk = sum(s.bytes for s in shards)
    return DryRunReport(
        method=plan.method.name,
        models=list(plan.model_ids),
        base_model=plan.base_id,
        compatibility=CompatibilityVerdict(compatible=True),
        tensors=len(plan.tasks),
        computed_tensors=sum(1 for t in plan.tasks if t.compute),
        input_bytes=sum(manifests[m].size_bytes for m in plan.model_ids),
        output_layers=plan.output_layers
        if plan.output_layers is not None
        else count_layers([t.output_name for t in plan.tasks]),
        output_dtype=plan.recipe.dtype or plan.recipe.compute_dtype,
        parameters=summarise_parameters(plan),
        shards=shards,
        estimates=DryRunEstimates(
            peak_memory_bytes=schedule.peak_bytes,
            disk_bytes=disk,
            wall_seconds=round(schedule.wall_s, 2),
            cpu_seconds=round(schedule.cpu_s, 2),
            memory_budget_bytes=budget_bytes,
            largest_tensor_bytes=schedule.largest_task_bytes,
            machine_slowness=round(speed, 3),
            kernel_ns_per_element=round(kernel_ns, 2),
            basis="the executor's schedule replayed (alloy.merge.footprint) with the method's kernel timed on this "
            "machine and calibrated reading and writing scaled by its measured slowness, on its cores at its "
            "present load",
        ),
    )


def summarise_parameters(plan: MergePlan) -> list[ParameterSummary]:
    """Every parameter's values as the merge resolves them, tensor by tensor (gradients, filters, slices)."""
    seen: dict[tuple[str, str], set[float]] = {}
    for task in plan.tasks:
        if not task.compute:
            continue
        shared, per_input = resolve_task_parameters(plan, task)
        for name, value in shared.items():
            _collect(seen, name, "shared", value)
        for position, values in enumerate(per_input):
            if position == task.base_index:
                continue  # mergekit binds per-input parameters to the other inputs only
            for name, value in values.items():
                _collect(seen, name, "per_input", value)
    summaries = []
    for (name, scope), found in seen.items():
        ordered = sorted(found)
        summaries.append(
            ParameterSummary(
                name=name,
                scope=scope,
                min=ordered[0],
                max=ordered[-1],
                distinct=len(ordered),
                values=ordered if len(ordered) <= MAX_DISTINCT_SHOWN else None,
            )
        )
    return summaries


def _collect(seen: dict[tuple[str, str], set[float]], name: str, scope: str, value: Any) -> None:
    if isinstance(value, bool | int | float):
        seen.setdefault((name, scope), set()).add(float(value))
