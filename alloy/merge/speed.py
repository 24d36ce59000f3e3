"""How fast this machine runs merge arithmetic, relative to the machine the dry run's time constants were calibrated
on (:mod:`alloy.merge.footprint`).

WHY: the constants are CPU nanoseconds per element measured on one machine, and two VMs of the same kind ran the same
merges 2.2x apart, so fixed constants made every time estimate 2x off on the slower one. A short probe of the same
kind of work (memory-bound elementwise passes over pieces and a sort of a piece, as the kernels do) timed on this
machine and divided by its time on the calibration machine scales the CPU estimates instead.

The probe runs on the calling thread only (its pieces are below torch's intra-op grain, so no op fans out to other
threads), is timed in that thread's CPU seconds (what other processes do to the wall clock is the load's business,
:func:`alloy.merge.footprint.present_load`), keeps the fastest of a few runs, and is measured once per process.
"""

from __future__ import annotations

import functools
import time

import torch

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
