"""How a merge process allocates memory: glibc's mmap threshold pinned (a predictable peak), and torch's large
buffers on transparent huge pages (fewer page faults). Torch-free, so that whoever starts a merge process (the CLI,
the Ray head whose workers merge) can prepare its environment without importing torch.
"""

from __future__ import annotations

import ctypes
import os

MMAP_THRESHOLD_BYTES = 1024**2  # glibc: blocks this large come from mmap and go back to the OS when freed
# glibc: free memory at the top of a heap is given back to the OS once it exceeds this. WHY: pinning the mmap
# threshold also pins this one at its 128 KiB default, so every 0.5 MB piece temporary freed on a merge thread had
# its heap shrunk (madvise) and the next piece faulted the pages back in: DARE-TIES over 4 x 1.35 GB models took
# 467k minor faults and 833 madvise calls with 128 KiB, 111k and 131 with 64 MiB, system CPU 6.3 -> 3.7 s. Only
# blocks under the mmap threshold stay, and only as many as were alive at once (a few MB of pieces a thread).
TRIM_THRESHOLD_BYTES = 64 * 1024**2
_M_TRIM_THRESHOLD = -1  # mallopt's parameter numbers (malloc.h)
_M_MMAP_THRESHOLD = -3

# torch's CPU allocator asks for transparent huge pages (madvise) for buffers of 2 MiB and more when this is set.
# WHY: a merge fills gigabytes of fresh buffers (its inputs, read whole), and on 4 KiB pages a page fault per 4 KiB
# was most of a TIES merge's system time: 4 x 1.35 GB models, 1.40M minor faults -> 0.13M, system CPU 6.9 -> 4.6 s,
# wall 14.7 -> 12.8 s (medians of 3, 2-vCPU VM); the task-arithmetic floor, which streams 4 MiB pieces, is
# unchanged. The peak resident set is the same (the buffers are touched whole). torch reads the variable once, at
# its first allocation in the process: it must be in the environment before then (use_huge_pages, TORCH_ENV).
TORCH_ENV = {"THP_MEM_ALLOC_ENABLE": "1"}


def use_huge_pages() -> None:
    """Put :data:`TORCH_ENV` in this process's environment (an operator's own setting wins). Effective only if
    torch has not allocated yet in this process; later calls change nothing."""
    for name, value in TORCH_ENV.items():
        os.environ.setdefault(name, value)


def fix_mmap_threshold() -> None:
    """Pin glibc's mmap threshold, and its trim threshold (see TRIM_THRESHOLD_BYTES). By default the mmap threshold
    grows to the largest block freed so far (up to 32 MiB), after which tensors of that size come from the heap and
    their pages stay resident after they are freed: the peak resident set then depends on the order tensors were
    freed in, not on the budget. Pinned, every tensor buffer is its own map, returned when freed. Nothing happens
    off glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
        libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    except (OSError, AttributeError):
        pass
