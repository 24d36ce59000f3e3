"""What a merge costs, from its plan alone: the working bytes of each tensor task (the executor's in-flight budget
counts these), and a replay of the executor's schedule that gives the peak memory and the wall time a dry run
reports. One model for both, so that what the dry run promises is what the executor enforces.

The constants are calibrated, not derived: ``bench/merge_bench.py --check-estimates`` runs real merges and prints
estimate / measured for each method; refit them there when a kernel changes. Calibrated on 2 shared vCPUs
(x86-64, torch CPU), fp32 inputs.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

from alloy.merge.plan import MergePlan, TensorTask

# Resident bytes of a merge process before its first tensor: the interpreter, torch and Alloy's imports.
BASE_RSS_BYTES = 330 * 1024**2
# Float32 temporaries a kernel holds at once beyond its inputs, in units of the output tensor (measured peak
# over one large tensor, 3 fine-tunes and a base). Methods not listed take DEFAULT_WORK_FACTOR.
WORK_FACTOR = {
    "linear": 2.0,
    "task_arithmetic": 2.0,
    "passthrough": 1.0,
    "slerp": 2.0,
    "ties": 3.5,
    "breadcrumbs": 3.5,
    "breadcrumbs_ties": 4.0,
    "dare_linear": 5.0,
    "dare_ties": 6.0,
    "della": 8.0,
    "della_linear": 8.0,
}
DEFAULT_WORK_FACTOR = 6.0
# CPU nanoseconds per input element (one element of one input) of a kernel, calibrated as above.
NS_PER_INPUT_ELEMENT = {
    "linear": 3.0,
    "task_arithmetic": 3.0,
    "passthrough": 0.5,
    "slerp": 26.0,
    "ties": 15.0,
    "breadcrumbs": 23.0,
    "breadcrumbs_ties": 23.0,
    "dare_linear": 30.0,
    "dare_ties": 37.0,
    "della": 73.0,
    "della_linear": 73.0,
}
DEFAULT_NS_PER_INPUT_ELEMENT = 40.0
READ_BYTES_PER_S = 1.5e9  # pread from a warm page cache into fresh buffers
WRITE_BYTES_PER_S = 0.8e9  # pwrite into the preallocated shards, then fsync
STARTUP_S = 3.0  # interpreter, imports, manifests, plan


def task_numel(task: TensorTask) -> int:
    count = 1
    for size in task.shape:
        count *= size
    return count


def working_bytes(plan: MergePlan, task: TensorTask) -> int:
    """Bytes resident while ``task`` runs: its inputs as float32 plus the kernel's temporaries (a copied tensor:
    the input and its converted copy)."""
    numel = task_numel(task)
    if not task.compute:
        return 2 * numel * max(task.dtype.itemsize, 1)
    factor = WORK_FACTOR.get(plan.method.name, DEFAULT_WORK_FACTOR)
    return int(numel * 4 * (len(task.sources) + factor))


def compute_seconds(plan: MergePlan, task: TensorTask) -> float:
    """CPU seconds of one task: the kernel, the read of its inputs and the write of its output."""
    numel = task_numel(task)
    ns = NS_PER_INPUT_ELEMENT.get(plan.method.name, DEFAULT_NS_PER_INPUT_ELEMENT) if task.compute else 0.5
    read = numel * 4 * len(task.sources) / READ_BYTES_PER_S
    write = numel * task.dtype.itemsize / WRITE_BYTES_PER_S
    return numel * len(task.sources) * ns * 1e-9 + read + write


@dataclass(frozen=True)
class ScheduleEstimate:
    peak_bytes: int  # resident set at its largest (the process's base included)
    wall_s: float
    cpu_s: float
    largest_task_bytes: int  # a task over the budget runs alone: the floor of any budget


def replay_schedule(
    plan: MergePlan, tasks: Sequence[TensorTask], *, workers: int, max_in_flight: int, budget_bytes: int, cpus: int
) -> ScheduleEstimate:
    """Replay the executor's admission rule (plan order; at most ``max_in_flight`` tasks and ``budget_bytes``
    working bytes in flight; one task over the budget runs alone) on ``min(workers, cpus)`` cores."""
    lanes = max(1, min(workers, max_in_flight, cpus))
    running: list[tuple[float, int, int]] = []  # (finish time, order, working bytes)
    now = used = peak = 0.0
    cpu = 0.0
    for order, task in enumerate(tasks):
        cost = min(working_bytes(plan, task), budget_bytes)
        while running and (len(running) >= lanes or used + cost > budget_bytes):
            now, _, freed = heapq.heappop(running)
            used -= freed
        seconds = compute_seconds(plan, task)
        cpu += seconds
        heapq.heappush(running, (now + seconds, order, cost))
        used += cost
        resident = sum(working_bytes(plan, tasks[o]) for _, o, _ in running)
        peak = max(peak, resident)
    end = max((finish for finish, _, _ in running), default=now)
    largest = max((working_bytes(plan, t) for t in tasks), default=0)
    return ScheduleEstimate(int(BASE_RSS_BYTES + peak), STARTUP_S + end, STARTUP_S + cpu, largest)
