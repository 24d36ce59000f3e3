"""How many torch intra-op threads each merge thread gets: ``alloy merge --threads``' default, per method.

Measured on 16 cores (``bench/merge_bench.py --alloy-args``, 4 fp32 models of 0.40 GB, 2 merge threads): with
16 / 2 = 8 intra-op threads each, DELLA took 14.2 s of wall and 111 CPU s, with 1 each 15.8 s and 24 CPU s; TIES
8.5 s either way, 21.7 and 12.2 CPU s (the floor's wall moved between 4.8 and 6.5 s across those runs). Elementwise
kernels and sorts gain nothing from more threads than the merge threads already run, and idle OpenMP threads spin.
An SVD is different: LAPACK spreads one tensor over every intra-op thread, and TSV-M (4 × 0.17 GB) took 18.7 s with
8 threads per merge thread and 29.9 s with one thread for each of 4 concurrent tensors. A method declares which it
is (``MethodSpec.threaded_kernel``).
"""

from __future__ import annotations

from kernels.specs import MethodSpec


def intra_op_threads(method: MethodSpec, cores: int, workers: int) -> int:
    """One per merge thread; the cores shared out among the merge threads for a method whose time is in LAPACK."""
    if method.threaded_kernel:
        return max(1, cores // max(1, workers))
    return 1
