"""How fast this machine runs merge work: a probe of memory-bound passes, relative to the machine the dry run's
reading and writing constants were calibrated on (:mod:`alloy.merge.footprint`), and the recipe's own kernel timed
here on synthetic inputs.

WHY: the constants are CPU nanoseconds per element measured on one machine, and two VMs of the same kind ran the same
merges 2.2x apart, so fixed constants made every time estimate 2x off on the slower one. A short probe of the same
kind of work (memory-bound elementwise passes over pieces and a sort of a piece, as the reading and writing do)
timed on this machine and divided by its time on the calibration machine scales them instead.

The probe runs on the calling thread only (its pieces are below torch's intra-op grain, so no op fans out to other
threads), is timed in that thread's CPU seconds (what other processes do to the wall clock is the load's business,
:func:`alloy.merge.footprint.present_load`), keeps the fastest of a few runs, and is measured once per process.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from alloy.merge.allocator import fix_mmap_threshold
from alloy.merge.footprint import task_numel
from alloy.merge.plan import MergePlan, TensorTask
from alloy.merge.tensor_merge import compute_tensor, resolve_task_parameters

PIECE = 32_000  # elements per op: below torch's intra-op grain (32,768), so every op runs on this thread
PIECES = 64  # 2M elements, 8 MB per tensor: larger than the caches, as merge inputs are
RUNS = 3
# The probe's CPU seconds on the calibration machine (the one of footprint's constants), fastest of RUNS.
CALIBRATION_PROBE_S = 0.025  # 0.0243-0.0268 in 6 runs, idle and beside two busy processes


def probe_seconds() -> float:
    """The fastest of :data:`RUNS` runs of the probe, in this thread's CPU seconds."""
    generator = torch.Generator().manual_seed(0)
    a = torch.rand(PIECE * PIECES, generator=generator)
    b = torch.rand(PIECE * PIECES, generator=generator)
    return min(_probe_once(a, b) for _ in range(RUNS))


def _probe_once(a: torch.Tensor, b: torch.Tensor) -> float:
    start = time.thread_time()
    for first in range(0, a.numel(), PIECE):
        x, y = a[first : first + PIECE], b[first : first + PIECE]
        delta = torch.sub(x, y)
        delta.abs_().mul_(0.5)
        y.add_(delta)
        if first % (8 * PIECE) == 0:
            torch.sort(delta)
    return time.thread_time() - start


@functools.cache
def slowness() -> float:
    """This machine's CPU seconds per calibration-machine CPU second for merge work (2.0: half as fast)."""
    return probe_seconds() / CALIBRATION_PROBE_S


# --- the recipe's own kernel, timed on this machine ------------------------------------------------------------
#
# WHY: one slowness for every method was not enough. The probe above is memory-bound, and on a VM where it ran 0.8x
# the calibration machine's time TIES and DELLA merges ran about 0.6x: their time is in selections and sorts, which
# a machine can do relatively faster or slower than it streams memory. So a dry run times the method's kernel on
# this machine, on synthetic inputs shaped like the plan's largest merged tensor (its rows whole, as many as make
# PROBE_ELEMENTS), with the parameters the plan resolves for that tensor, and the calibrated constants keep only the
# reading, converting and writing around the kernel, which the memory probe scales.

# Per input: 16 MB of float32, so that a tensor's fixed costs (the top-k's sample, each call's dispatch) weigh about
# as little as on a merge's large tensors (at 1M entries TIES and breadcrumbs probed 20% slower than at 4M) and the
# inputs outgrow the last-level cache as a merge's do. DELLA, the costliest, probes in about 0.8 s.
PROBE_ELEMENTS = 1 << 22
KERNEL_RUNS = 2
# A run this long is timed once: its noise is small beside it, and a second would double the dry run (an SVD
# method's kernel, TSV-M on a 4096 x 1024 probe: about 6 s a run on 2 vCPUs).
SLOW_RUN_S = 0.25
_kernel_rates: dict[tuple, float] = {}


def probe_task(plan: MergePlan) -> TensorTask | None:
    """The merged tensor whose kernel the dry run times: the largest one the method computes (the time is in
    those), not one whose rows are first aligned to a vocabulary (that copy is not the method's)."""
    computed = [t for t in plan.tasks if t.compute and t.vocabulary is None]
    return max(computed, key=task_numel, default=None)


def probe_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """``shape`` cut to about PROBE_ELEMENTS by whole rows (kernels that rank along rows see rows of the real
    length); a 1-D tensor cut to PROBE_ELEMENTS."""
    if len(shape) < 2:
        return (min(shape[0] if shape else 1, PROBE_ELEMENTS),)
    row = 1
    for size in shape[1:]:
        row *= size
    return (max(1, min(shape[0], PROBE_ELEMENTS // max(row, 1))), *shape[1:])


def kernel_ns_per_input_element(plan: MergePlan, task: TensorTask, threads: int = 1, lanes: int = 1) -> float:
    """This machine's CPU nanoseconds per input element of ``plan``'s kernel on ``task``'s rows and parameters,
    run by ``lanes`` merge threads at once with ``threads`` torch intra-op threads each, as the executor runs them
    (side by side they share the memory bus and the interpreter's lock: on 2 vCPUs TIES's kernel took 6.2 ns per
    element alone and 7.8 beside another): the fastest of KERNEL_RUNS runs, remembered per method, shape,
    parameters, threads and lanes for this process."""
    shared, per_input = resolve_task_parameters(plan, task)
    shape = probe_shape(task.shape)
    key: tuple = (plan.method.name, shape, len(task.sources), task.base_index, repr(shared), repr(per_input))
    key += (task.dtype, plan.recipe.compute_dtype, plan.recipe.is_mergekit, threads, lanes)
    if key not in _kernel_rates:
        _kernel_rates[key] = _time_kernel(plan, dataclasses.replace(task, shape=shape), threads, lanes)
    return _kernel_rates[key]


def _time_kernel(plan: MergePlan, task: TensorTask, threads: int, lanes: int) -> float:
    generator = torch.Generator().manual_seed(0)
    # the output's dtype: a plan knows its inputs' dtypes only model by model, and they are the output's as a rule
    dtype = task.dtype if task.dtype.is_floating_point else torch.float32
    base = torch.randn(task.shape, generator=generator).mul_(0.02)
    # fine-tunes: the base plus a small delta, as the models a merge combines are
    inputs = [base] + [base + torch.randn(task.shape, generator=generator).mul_(0.002) for _ in task.sources[1:]]
    inputs = [t.to(dtype) for t in inputs]
    fix_mmap_threshold()  # the allocator as a merge runs it: its temporaries' page faults are part of its time
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with ThreadPoolExecutor(max_workers=lanes) as pool:
            best = math.inf
            for _ in range(KERNEL_RUNS):
                copies = [[t.clone() for t in inputs] for _ in range(lanes)]  # the kernel may write into them
                start = time.process_time()  # the process: every lane and intra-op thread counts
                for done in [pool.submit(compute_tensor, plan, task, owned, owned=True) for owned in copies]:
                    done.result()
                best = min(best, time.process_time() - start)
                if best >= SLOW_RUN_S * lanes:
                    break
    finally:
        torch.set_num_threads(previous)
    return best * 1e9 / (task_numel(task) * len(task.sources) * lanes)
