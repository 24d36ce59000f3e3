"""What a merge costs, from its plan alone: the working bytes of each tensor task (the executor's in-flight budget
counts these), and a replay of the executor's schedule that gives the peak memory and the wall time a dry run
reports. One model for both, so that what the dry run promises is what the executor enforces.

The memory constants are calibrated, not derived: ``bench/merge_bench.py --check-estimates`` runs real merges and
prints estimate / measured for each method; refit them there when a kernel changes. Calibrated on 2 shared vCPUs
(x86-64, torch CPU), fp32 inputs, one torch thread per merge thread (``alloy merge --threads``' default there).
Time has two parts: the kernel's, measured by the dry run on the machine that asks (:mod:`alloy.merge.speed`
times the method's kernel on inputs shaped like the plan's largest tensor), and the reading and writing around it,
a calibrated constant scaled by that machine's measured slowness (two VMs of the same kind ran the same merges
2.2x apart). Memory and disk do not scale.
"""

from __future__ import annotations

import heapq
import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from alloy.merge import streamed as streaming
from alloy.merge.plan import MergePlan, TensorTask
from kernels import reductions

# Resident bytes of a merge process before its first tensor: the interpreter, torch and Alloy's imports.
BASE_RSS_BYTES = 250 * 1024**2  # a merge of tiny models peaked at 0.25-0.26 GB (bench/merge_bench.py, 2026-11-27)
# Float32 temporaries a kernel holds at once beyond its inputs, in units of the output tensor: the peak of a
# merge whose largest tensor runs alone, less the base, over that tensor's float32 bytes, less the inputs. The
# executor hands kernels the inputs it read (``owned``), which most kernels reuse for their results.
WORK_FACTOR = {
    "linear": 0.25,
    "task_arithmetic": 0.25,
    "passthrough": 0.0,
    "slerp": 0.0,  # written into its base's buffer; its gram scratch is SCRATCH_BYTES_PER_ELEMENT
    "ties": 0.5,
    "breadcrumbs": 0.75,
    "breadcrumbs_ties": 0.75,
    "dare_linear": 0.5,  # draws its noise a piece at a time (kernels.sparsify.MASK_PIECE)
    "dare_ties": 0.5,
    "della": 0.5,  # ranks, draws and masks a block of rows at a time (kernels.sparsify)
    "della_linear": 0.5,
    "sce": 1.5,  # the variance whole (its top-k), a byte-per-entry mask; the rest by pieces (kernels.sce)
    # The SVD methods hold float64 factors: each task's U (2 units for a tall matrix), their concatenation and its
    # polar factor, and LAPACK's workspace. Measured as the kernel's peak less its inputs on one tall tensor with 3
    # tasks (24000 x 1024, 8000 x 512, 4000 x 512): TSV-M 20.1-23.1, Iso-C 13.3-20.6, Iso-CTS 22.1-32.6 (a whole
    # merge of 4 x 0.40 GB models peaked at 2.67 and 2.90 GB for TSV-M and Iso-CTS, against 1.0 GB estimated with
    # the default factor, which also let the executor run their mid-size tensors about 3x over its budget). The middle
    # of each range: an estimate within 25% on the bench's shapes, the budget kept within about 20% on smaller ones.
    "tsv": 21.5,
    "iso_c": 17.5,
    "iso_cts": 27.5,
}
DEFAULT_WORK_FACTOR = 4.0
# Scratch of a kernel's whole-tensor sums, per element of at most one chunk (kernels.reductions.CHUNK) of its
# tensor, streamed or not: slerp's gram sums convert a chunk of both inputs to float64 and hold their three
# products at once.
SCRATCH_BYTES_PER_ELEMENT = {"slerp": 5 * 8}
# CPU nanoseconds per input element (one element of one input) around the kernel: reading it from the page cache,
# converting it and writing the output. The kernel's own time is measured on the machine that asks
# (alloy.merge.speed.kernel_ns_per_input_element). Calibrated on bench/merge_bench.py's task-arithmetic floor (its
# CPU seconds less its start and its kernel, over its input elements: 3.9 ns at a slowness of 0.81) on a quiet
# 2-vCPU machine, and expressed for the machine whose probe time is alloy.merge.speed.CALIBRATION_PROBE_S (the
# wall estimate stretches them for the load it sees).
IO_NS_PER_INPUT_ELEMENT = 4.8
COPY_NS_PER_ELEMENT = 1.0  # a tensor the method does not compute (integer buffers): read and written
# Interpreter, imports, manifests, plan (wall and CPU alike), where the caller cannot measure its own (the CLI
# does: its dry run is the same process start).
STARTUP_S = 2.9


# A task running alone gains this much speed per extra merge thread's core (alone_speedup).
ALONE_GAIN_PER_LANE = 0.4


def task_numel(task: TensorTask) -> int:
    count = 1
    for size in task.shape:
        count *= size
    return count


def working_bytes(plan: MergePlan, task: TensorTask, streamed: bool = True) -> int:
    """Bytes resident while ``task`` runs: its inputs as float32 plus the kernel's temporaries (a copied tensor:
    the input and its converted copy); a task the executor streams (:func:`alloy.merge.streamed.streams`; not
    with ``streamed=False``, a merge on a GPU) holds a piece of each instead, plus its sums' scratch."""
    numel = task_numel(task)
    if not task.compute:
        return 2 * numel * max(task.dtype.itemsize, 1)
    scratch = min(numel, reductions.CHUNK) * SCRATCH_BYTES_PER_ELEMENT.get(plan.method.name, 0)
    if streamed and streaming.streams(plan, task):
        return streaming.PIECE_ELEMENTS * 4 * (len(task.sources) + 1) + scratch
    factor = WORK_FACTOR.get(plan.method.name, DEFAULT_WORK_FACTOR)
    return int(numel * 4 * (len(task.sources) + factor)) + scratch


def runs_alone(plan: MergePlan, task: TensorTask, budget_bytes: int, streamed: bool = True) -> bool:
    """Whether ``task`` is over the in-flight budget: the executor runs it alone, on every merge thread's cores."""
    return working_bytes(plan, task, streamed) >= budget_bytes


def alone_speedup(lanes: int) -> float:
    """How much faster a task runs alone on ``lanes`` merge threads' cores than on one (its reads and writes on
    threads, its ops on intra-op threads). Measured on 2 vCPUs: the embeddings of a TIES merge over 4 x 1.35 GB
    models, 1.38 -> 0.97 s of kernel (x1.42); more lanes are assumed to add as much each (not measured)."""
    return 1.0 + ALONE_GAIN_PER_LANE * (lanes - 1)


def compute_seconds(plan: MergePlan, task: TensorTask, kernel_ns: float, slowness: float) -> float:
    """CPU seconds of one task: the reads of its inputs and the write of its output (calibrated, times this
    machine's ``slowness``) and the kernel (``kernel_ns`` per input element, measured on this machine)."""
    if not task.compute:
        return task_numel(task) * COPY_NS_PER_ELEMENT * slowness * 1e-9
    io_ns = IO_NS_PER_INPUT_ELEMENT * slowness * streaming.read_passes(plan, task)
    return task_numel(task) * len(task.sources) * (io_ns + kernel_ns) * 1e-9


def execution_order(tasks: Sequence[TensorTask]) -> list[TensorTask]:
    """The order the executor starts tasks in: the longest first (input elements; a copied tensor counts as
    nothing), ties in plan order. WHY: a merge's largest tensors (the embeddings, last in a Llama plan) are also its
    longest tasks; started last, the last one ran alone on one core while the other idled. Started first, the
    small ones fill the other cores around them (TIES over four 0.4 GB models on 2 vCPUs: 4.5 -> 4.2 s of wall).
    The writer's slots take tensors in any order, and every tensor's seed is its name's: the output is the same."""
    return sorted(tasks, key=lambda t: -task_numel(t) * len(t.sources) if t.compute else 0)


@dataclass(frozen=True)
class ScheduleEstimate:
    peak_bytes: int  # resident set at its largest (the process's base included)
    wall_s: float
    cpu_s: float
    largest_task_bytes: int  # a task over the budget runs alone: the floor of any budget


def replay_schedule(
    plan: MergePlan,
    tasks: Sequence[TensorTask],
    *,
    workers: int,
    max_in_flight: int,
    budget_bytes: int,
    cpus: int,
    load: float = 0.0,
    slowness: float = 1.0,
    kernel_ns: float = 0.0,
    startup_s: float | None = None,
) -> ScheduleEstimate:
    """Replay the executor's admission rule (:func:`execution_order`; at most ``max_in_flight`` tasks and
    ``budget_bytes`` working bytes in flight; one task over the budget runs alone, :func:`alone_speedup` faster) on
    :func:`merge_lanes` lanes,
    then stretch the time by the share of the ``cpus`` cores the merge gets beside ``load`` other runnable threads
    (the scheduler's fair share: ``cpus * k / (load + k)`` cores for ``k`` threads, once the cores are
    oversubscribed).
    ``slowness``: this machine's CPU seconds per second of the calibration machine (:mod:`alloy.merge.speed`);
    ``kernel_ns``: the method's kernel on this machine, CPU ns per input element; ``startup_s``: the merge
    process's start, measured (else STARTUP_S scaled by the slowness)."""
    lanes = merge_lanes(workers, max_in_flight, cpus)
    running: list[tuple[float, int, int]] = []  # (finish time, order, working bytes)
    now = used = peak = 0.0
    cpu = 0.0
    tasks = execution_order(tasks)
    for order, task in enumerate(tasks):
        cost = min(working_bytes(plan, task), budget_bytes)
        while running and (len(running) >= lanes or used + cost > budget_bytes):
            now, _, freed = heapq.heappop(running)
            used -= freed
        seconds = compute_seconds(plan, task, kernel_ns, slowness)
        cpu += seconds
        if lanes > 1 and runs_alone(plan, task, budget_bytes):
            seconds /= alone_speedup(lanes)
        heapq.heappush(running, (now + seconds, order, cost))
        used += cost
        resident = sum(working_bytes(plan, tasks[o]) for _, o, _ in running)
        peak = max(peak, resident)
    end = max((finish for finish, _, _ in running), default=now)
    end = max(end, cpu / lanes)  # a lane finishing early does not give the others its core
    largest = max((working_bytes(plan, t) for t in tasks), default=0)
    startup = STARTUP_S * slowness if startup_s is None else startup_s
    wall = startup / cpu_share(1, cpus, load) + end * lanes / cpu_share(lanes, cpus, load)
    return ScheduleEstimate(int(BASE_RSS_BYTES + peak), wall, startup + cpu, largest)


def merge_lanes(workers: int, max_in_flight: int, cpus: int) -> int:
    """Merge threads at work at once: the executor's workers, at most its in-flight tasks and the cores."""
    return max(1, min(workers, max_in_flight, cpus))


def cpu_share(threads: int, cpus: int, load: float) -> float:
    """Cores ``threads`` busy threads get on ``cpus`` cores beside ``load`` other runnable ones."""
    if load + threads <= cpus:
        return float(threads)
    return cpus * threads / (load + threads)


def usable_cores() -> int:
    """The cores this process may run on (its affinity where the OS has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def present_load(samples: int = 5, interval_s: float = 0.1) -> float:
    """Runnable threads other than this one, the median of a few instant readings of /proc/loadavg's running
    count. Not the load average: a minute's average still counts the work that has just ended (a previous merge),
    which would not compete with this one. Off Linux, the 1-minute load average."""
    readings = []
    for k in range(samples):
        try:
            running = Path("/proc/loadavg").read_text().split()[3].split("/")[0]
        except (OSError, IndexError):
            return os.getloadavg()[0]
        readings.append(max(0, int(running) - 1))
        if k + 1 < samples:
            time.sleep(interval_s)
    return float(statistics.median(readings))
