"""A merge process's allocator: torch's large buffers on transparent huge pages, set before torch's first
allocation by whoever starts a merge process (the CLI, every Ray node we start, cluster.yaml)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from alloy.control.ray_head import SERVE_ENV
from alloy.merge.allocator import TORCH_ENV, use_huge_pages

ROOT = Path(__file__).resolve().parents[2]
THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def test_use_huge_pages_sets_the_torch_variable_and_keeps_an_operators_own(monkeypatch):
    monkeypatch.delenv("THP_MEM_ALLOC_ENABLE", raising=False)
    use_huge_pages()
    assert os.environ["THP_MEM_ALLOC_ENABLE"] == "1"
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "0")
    use_huge_pages()
    assert os.environ["THP_MEM_ALLOC_ENABLE"] == "0"


def test_cluster_yaml_starts_every_node_with_the_merge_environment():
    cluster = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    head = " ".join(cluster["head_start_ray_commands"])
    worker = " ".join(cluster["worker_start_ray_commands"])
    for name, value in TORCH_ENV.items():
        assert f"{name}={value}" in head
        assert f"{name}={value}" in worker
    for name, value in SERVE_ENV.items():
        assert f"{name}={value}" in head


FAULTS = """
import resource, sys
from alloy.merge.allocator import use_huge_pages
if sys.argv[1] == "on":
    use_huge_pages()
import torch
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
torch.ones(1 << 24)  # 64 MiB
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(
    not THP_MODE.exists() or "[never]" in THP_MODE.read_text(), reason="the kernel gives no transparent huge pages"
)
def test_a_64_mib_buffer_takes_a_fraction_of_the_page_faults():
    env = {k: v for k, v in os.environ.items() if k not in TORCH_ENV}

    def faults(mode: str) -> int:
        out = subprocess.run([sys.executable, "-c", FAULTS, mode], env=env, capture_output=True, text=True, check=True)
        return int(out.stdout.split()[-1])

    off, on = faults("off"), faults("on")
    assert off >= 16_000  # 4 KiB pages: one fault each
    assert on * 8 < off


KEPT = """
import ctypes, sys
from alloy.merge.allocator import fix_mmap_threshold
if sys.argv[1] == "fixed":
    fix_mmap_threshold()
class Info(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.free.argtypes, libc.mallinfo2.restype = ctypes.c_void_p, [ctypes.c_void_p], Info
blocks = [libc.malloc(512 * 1024) for _ in range(16)]  # piece-sized, under the mmap threshold: from the heap
for block in reversed(blocks):
    libc.free(block)
print(libc.mallinfo2().keepcost)  # free bytes left at the top of the heap, ready for the next pieces
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_freed_piece_temporaries_stay_in_the_heap_for_the_next_pieces():
    def kept(mode: str) -> int:
        out = subprocess.run([sys.executable, "-c", KEPT, mode], capture_output=True, text=True, check=True)
        return int(out.stdout.split()[-1])

    assert kept("fixed") >= 8 * 512 * 1024  # 8 MB freed: kept, not handed back and faulted in again
    assert kept("default") < 8 * 512 * 1024  # what the test tells apart: glibc's default trims at 128 KiB
