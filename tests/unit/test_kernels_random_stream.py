"""The random masks (DARE, DELLA, breadcrumbs' draws) give entry i of a tensor the i-th uniform draw of its per-tensor
generator. ``kernels.sparsify`` draws them ``RANDOM_CHUNK`` at a time to bound their memory; that is only the same
mask for every chunk size because torch's CPU generator yields the same sequence whatever the sizes of the
``torch.rand`` calls. Pinned here against the 2**24-element calls every earlier Alloy version drew with, so that a
torch whose generator fills in blocks fails this test instead of silently changing every seeded merge."""

from __future__ import annotations

import pytest
import torch

from kernels import sparsify
from kernels.sparsify import _draw_keep_, della_prune_

FORMER_CHUNK = 1 << 24


def draws(numel: int, chunk: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.cat([torch.rand(min(chunk, numel - s), generator=generator) for s in range(0, numel, chunk)])


@pytest.mark.parametrize("numel, chunk", [(FORMER_CHUNK + 12_345, sparsify.RANDOM_CHUNK), (100_003, 7), (33, 16)])
def test_the_draw_sequence_does_not_depend_on_the_call_sizes(numel, chunk):
    assert torch.equal(draws(numel, chunk, 11), draws(numel, FORMER_CHUNK, 11))


def test_the_chunk_bounds_the_draws_memory():
    assert sparsify.RANDOM_CHUNK <= 1 << 20  # 4 MB of draws per call


def test_masks_are_those_of_the_former_chunk_size(monkeypatch):
    """A DARE and a DELLA mask over more than one new chunk are the masks drawn with the former chunk size."""
    x = torch.randn(2_500_000, generator=torch.Generator().manual_seed(3)).view(1250, 2000)
    monkeypatch.setattr(sparsify, "RANDOM_CHUNK", FORMER_CHUNK)
    former_dare = _draw_keep_(x.clone(), 0.3, torch.Generator().manual_seed(8))
    former_della = della_prune_(x.clone(), 0.4, 0.1, torch.Generator().manual_seed(8), True)
    monkeypatch.undo()
    assert x.numel() > 2 * sparsify.RANDOM_CHUNK
    assert torch.equal(_draw_keep_(x.clone(), 0.3, torch.Generator().manual_seed(8)), former_dare)
    assert torch.equal(della_prune_(x.clone(), 0.4, 0.1, torch.Generator().manual_seed(8), True), former_della)
