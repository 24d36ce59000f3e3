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


def test_masks_are_those_of_the_former_whole_draws():
    """DARE (bernoulli and random drop) and DELLA masks, drawn a piece at a time, are the masks of the former
    2**24-element draws compared with the keep probabilities."""
    x = torch.randn(2_500_000, generator=torch.Generator().manual_seed(3)).view(1250, 2000)
    former = draws(x.numel(), FORMER_CHUNK, 8).view_as(x)
    assert x.numel() > 2 * sparsify.RANDOM_CHUNK
    assert torch.equal(_draw_keep_(x.clone(), 0.3, torch.Generator().manual_seed(8)), x * (former < 0.3))
    dropped = sparsify.random_drop_(x.clone(), 0.3, False, torch.Generator().manual_seed(8))
    assert torch.equal(dropped, x * (former >= 0.3))
    kept = x * (former < sparsify.della_keep_probability(x, 0.4, 0.1))
    expected = sparsify._rescale_l1_(kept, float(sparsify.stable_abs_sum(x)))
    assert torch.equal(della_prune_(x.clone(), 0.4, 0.1, torch.Generator().manual_seed(8), True), expected)


def test_draw_pieces_are_cache_sized_on_the_cpu_and_whole_chunks_elsewhere():
    """The masks' draws come a cache-sized piece at a time into one reused buffer on the CPU, and RANDOM_CHUNK at a
    time (each moved over once) for another device; either way entry i gets the i-th draw."""
    numel = 2 * sparsify.RANDOM_CHUNK + 7
    starts, pointers, values = [], set(), []
    for start, piece in sparsify._uniform_pieces(numel, torch.Generator().manual_seed(5), torch.device("cpu")):
        starts.append(start)
        pointers.add(piece.data_ptr())
        values.append(piece.clone())
    assert starts == list(range(0, numel, sparsify.MASK_PIECE)) and len(pointers) == 1
    assert torch.equal(torch.cat(values), draws(numel, FORMER_CHUNK, 5))
    elsewhere = [start for start, _ in sparsify._uniform_pieces(numel, torch.Generator(), torch.device("meta"))]
    assert elsewhere == [0, sparsify.RANDOM_CHUNK, 2 * sparsify.RANDOM_CHUNK]
