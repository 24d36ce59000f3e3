"""Task-vector sparsification: exact top-k magnitude trim, rank-based stochastic pruning and random drop.

Top-k is an exact linear-time selection (:mod:`kernels.selection`) rather than a sort; ties at the threshold are
broken by position so the kept count is exactly ``k = max(1, int(density * n))`` as in mergekit.
All functions return a new float32 tensor or modify a tensor the caller owns (named ``owned``).
"""

from __future__ import annotations

import torch

from kernels import selection
from kernels.errors import InvalidParameterError
from kernels.pieces import PIECE
from kernels.reductions import stable_abs_sum

# Entry i of a tensor gets the i-th uniform draw of its generator whatever the sizes of the ``torch.rand`` calls:
# torch's CPU generator yields one number per element in order (pinned by tests/unit/test_kernels_random_stream.py
# against the 2**24-element calls every mask was drawn with before). So the masks draw a cache-sized piece at a
# time into one reused buffer, and the few whole-tensor draws (:func:`uniform`) RANDOM_CHUNK at a time.
RANDOM_CHUNK = 1 << 20
MASK_PIECE = PIECE  # elements per draw and float-mask step (kernels.pieces)


def keep_count(density: float, numel: int) -> int:
    return max(1, int(density * numel))


def top_magnitude_mask(x: torch.Tensor, density: float) -> torch.Tensor | None:
    """Boolean mask of the ``density`` fraction of largest-magnitude entries; None means keep everything."""
    numel = x.numel()
    if density >= 1:
        return None
    if density <= 0 or numel == 0:
        return torch.zeros_like(x, dtype=torch.bool)
    k = keep_count(density, numel)
    if k >= numel:
        return None
    return top_k_mask(x, k).view_as(x)


def _flat_float32(values: torch.Tensor) -> torch.Tensor:
    return values.detach().reshape(-1).to(device="cpu", dtype=torch.float32)


def top_k_mask(values: torch.Tensor, k: int) -> torch.Tensor:
    """Boolean mask (flat) of the ``k`` largest magnitudes of ``values`` (callers pass magnitudes or variances,
    which are their own magnitudes), exactly ``k`` of them: entries equal to the threshold are kept first by
    position. (mergekit ranks with an fp32 argsort that is unstable at ties, so which of several equal entries it
    keeps is arbitrary; ours is the first ones.)"""
    numel = values.numel()
    if k <= 0:
        return torch.zeros(numel, dtype=torch.bool, device=values.device)
    if k >= numel:
        return torch.ones(numel, dtype=torch.bool, device=values.device)
    flat = _flat_float32(values)
    return selection.cut_mask(flat, selection.top_cut(flat, k)).to(values.device)


def magnitude_trim_(owned: torch.Tensor, density: float) -> torch.Tensor:
    """TIES trim: zero all but the top ``density`` fraction by magnitude (in place)."""
    numel = owned.numel()
    if density >= 1 or numel == 0:
        return owned
    if density <= 0:
        return owned.zero_()
    k = keep_count(density, numel)
    if k >= numel:
        return owned
    if owned.dtype != torch.float32 or owned.device.type != "cpu" or not owned.is_contiguous():
        mask = top_k_mask(owned, k).view_as(owned)
        return owned.masked_fill_(~mask.to(owned.device), 0.0)  # not mul_: a dropped inf must become 0, not NaN
    flat = owned.view(-1)
    selection.keep_cut_(flat, selection.top_cut(flat, k))
    return owned


def uniform(numel: int, generator: torch.Generator) -> torch.Tensor:
    """``numel`` uniform [0, 1) draws on the CPU, drawn in fixed chunks so the sequence is reproducible."""
    return (
        torch.cat(
            [
                torch.rand(min(RANDOM_CHUNK, numel - start), generator=generator)
                for start in range(0, numel, RANDOM_CHUNK)
            ]
        )
        if numel
        else torch.empty(0)
    )


def ranked_stochastic_prune_(
    owned: torch.Tensor, density: float, epsilon: float, generator: torch.Generator
) -> torch.Tensor:
    """Magnitude-ranked stochastic pruning (DELLA's MagPrune): entry of magnitude rank r (0 = smallest) of n is kept
    with probability ``p = density - epsilon + 2 * epsilon * r / (n - 1)`` and survivors are divided by ``p`` so the
    expectation of every entry is unchanged."""
    if density - epsilon < 0 or density + epsilon > 1:
        raise InvalidParameterError(
            "epsilon", f"density ± epsilon must lie in [0, 1] (density={density}, epsilon={epsilon})"
        )
    numel = owned.numel()
    if numel == 0:
        return owned
    flat = owned.view(-1)
    order = torch.argsort(selection.magnitude_keys(flat.cpu()), stable=True)  # int32 keys: the same order, faster
    ranks = torch.empty(numel, dtype=torch.float32)
    ranks[order] = torch.arange(numel, dtype=torch.float32)
    probability = ranks.mul_(2 * epsilon / max(numel - 1, 1)).add_(density - epsilon)
    keep = uniform(numel, generator) < probability
    scale = torch.where(keep, 1.0 / probability.clamp_min(1e-12), 0.0).to(owned.device)
    flat.mul_(scale)
    return owned


def random_drop_(owned: torch.Tensor, drop_rate: float, rescale: bool, generator: torch.Generator) -> torch.Tensor:
    """DARE: drop each entry with probability ``drop_rate``; survivors times ``1 / (1 - drop_rate)`` when
    ``rescale``. ``drop_rate == 0`` is the identity and draws nothing."""
    if drop_rate <= 0:
        return owned
    flat = owned.view(-1)
    keep = None
    for start, draws in _uniform_pieces(flat.numel(), generator, owned.device):
        count = draws.numel()
        if keep is None:  # one mask buffer for every piece (the first piece is the largest)
            keep = torch.empty(count, dtype=torch.bool, device=draws.device)
        flat[start : start + count].mul_(torch.ge(draws, drop_rate, out=keep[:count]))
    if rescale and drop_rate < 1:
        owned.mul_(1.0 / (1.0 - drop_rate))
    return owned


def _uniform_pieces(numel: int, generator: torch.Generator, device: torch.device):
    """``(start, draws)`` for consecutive pieces of a tensor's uniform draws (drawn on the CPU), on ``device``. On
    the CPU a cache-sized piece at a time into one reused buffer (WHY: a fresh RANDOM_CHUNK of draws per call is a
    new 4 MB map, and its page faults were half of DARE's system time, 1.5 of 3.3 s on four 0.4 GB models);
    elsewhere RANDOM_CHUNK at a time, each moved over once (fewer, larger copies)."""
    size = MASK_PIECE if device.type == "cpu" else RANDOM_CHUNK
    buffer = torch.empty(min(size, numel), dtype=torch.float32)
    for start in range(0, numel, size):
        count = min(size, numel - start)
        draws = torch.rand(count, generator=generator, out=buffer[:count])
        yield start, draws if device.type == "cpu" else draws.to(device)


# --- mergekit 0.1.5 sparsifiers (used by kernels.gta) ----------------------------------------------------------
# Each takes a task vector the caller owns, prunes it in place and, with ``rescale``, multiplies the survivors so
# the L1 norm of the pruned vector equals the L1 norm before pruning (mergekit's RescaleNorm.l1; it is *not* a
# division by the keep probability). Norms below RESCALE_EPS on either side skip the rescale, as in mergekit.

RESCALE_EPS = 1e-7


def _rescale_l1_(owned: torch.Tensor, l1_before: float) -> torch.Tensor:
    l1_after = float(stable_abs_sum(owned))
    if owned.dtype in (torch.bfloat16, torch.float16):  # computing in a reduced dtype (kernels.gta_reduced):
        # mergekit's two norms and their ratio are tensors of that dtype, each rounded once
        before, after = (torch.tensor(v, dtype=owned.dtype) for v in (l1_before, l1_after))
        if before < RESCALE_EPS or after < RESCALE_EPS:
            return owned
        return owned.mul_(before / after)
    if l1_before < RESCALE_EPS or l1_after < RESCALE_EPS:
        return owned
    return owned.mul_(l1_before / l1_after)


def _l1(owned: torch.Tensor, rescale: bool) -> float:
    return float(stable_abs_sum(owned)) if rescale else 0.0


def magnitude_prune_(owned: torch.Tensor, density: float, rescale: bool = False) -> torch.Tensor:
    """TIES trim: keep the ``max(1, int(density * n))`` largest magnitudes (density >= 1: untouched, no rescale;
    density <= 0: all zero)."""
    if density >= 1:
        return owned
    if density <= 0 or owned.numel() == 0:
        return owned.zero_()
    before = _l1(owned, rescale)
    magnitude_trim_(owned, density)
    return _rescale_l1_(owned, before) if rescale else owned


def _draw_keep_(owned: torch.Tensor, probability: torch.Tensor | float, generator: torch.Generator) -> torch.Tensor:
    """Keep entry i when the i-th uniform draw (row-major order; the sequence is the same whatever the sizes of the
    ``torch.rand`` calls) is below its keep probability; zero it otherwise (multiply by 0: a dropped -x becomes
    -0, a dropped inf NaN)."""
    flat = owned.view(-1)
    flat_probability = probability.reshape(-1) if isinstance(probability, torch.Tensor) else None
    difference = None
    for start, draws in _uniform_pieces(flat.numel(), generator, owned.device):
        count = draws.numel()
        if difference is None:  # one buffer for every piece (the first piece is the largest)
            difference = torch.empty_like(draws)
        if flat_probability is None:  # in float32, as ``draws < probability`` compares
            keep = difference[:count].fill_(float(probability)).sub_(draws)
        else:
            part = flat_probability[start : start + count].to(torch.float32)
            keep = torch.sub(part, draws, out=difference[:count])
        flat[start : start + count].mul_(_below_as_float_(keep))
    return owned


def _below_as_float_(difference: torch.Tensor) -> torch.Tensor:
    """``probability - draw`` -> 1.0 where the draw is below the probability, +0.0 elsewhere (in place): the values
    multiplying by the bool ``draw < probability`` multiplies by, in float ops (bool ones were several times
    slower). Exact: for floats ``p - u > 0`` exactly when ``p > u``."""
    return difference.relu_().sign_()


def bernoulli_prune_(
    owned: torch.Tensor, density: float, generator: torch.Generator, rescale: bool = True
) -> torch.Tensor:
    """DARE: keep each entry with probability ``density``. density >= 1 and density <= 0 draw nothing (untouched and
    all zero respectively), so they do not shift the draws of later models."""
    if density >= 1:
        return owned
    if density <= 0:
        return owned.zero_()
    before = _l1(owned, rescale)
    _draw_keep_(owned, density, generator)
    return _rescale_l1_(owned, before) if rescale else owned


def outlier_prune_(owned: torch.Tensor, density: float, gamma: float, rescale: bool = False) -> torch.Tensor:
    """Model Breadcrumbs: drop the ``int(gamma * n)`` largest magnitudes, then keep the next ``int(density * n)``
    (no minimum of one here, unlike TIES); when gamma + density > 1 fewer of the largest are dropped, so the kept
    count is always ``int(density * n)``. Ties: of equal magnitudes, the earlier position counts as larger."""
    if density >= 1:
        return owned
    numel = owned.numel()
    target = int(density * numel)
    n_top = int(gamma * numel)
    n_bottom = max(0, numel - target - n_top)
    dropped_top = max(0, numel - n_bottom - target)  # the largest entries removed
    before = _l1(owned, rescale)
    if owned.dtype == torch.float32 and owned.device.type == "cpu" and owned.is_contiguous():
        _keep_rank_band_(owned.view(-1), dropped_top, dropped_top + target)
    else:
        keep = _rank_band_mask(owned, dropped_top, dropped_top + target)
        owned.masked_fill_(~keep.view_as(owned), 0.0)  # not mul_: a dropped inf must become 0, not NaN
    return _rescale_l1_(owned, before) if rescale else owned


def _keep_rank_band_(flat: torch.Tensor, first: int, stop: int) -> None:
    """In place, what masking with :func:`_rank_band_mask` does (outside entries become +0), in float passes over
    cache-sized pieces instead of building a mask: zero below the ``stop`` cut, then the ``first`` largest."""
    numel = flat.numel()
    if stop <= first or first >= numel:
        flat.zero_()
        return
    inner = selection.top_cut(flat, first) if first > 0 else None  # both cuts before the data changes
    if stop < numel:
        selection.keep_cut_(flat, selection.top_cut(flat, stop))
    if inner is not None:
        selection.drop_cut_(flat, inner)


def _rank_band_mask(values: torch.Tensor, first: int, stop: int) -> torch.Tensor:
    """Flat mask of the entries of descending magnitude rank ``first <= r < stop`` (equal magnitudes: the earlier
    position ranks higher)."""
    numel = values.numel()
    if stop <= first or first >= numel:
        return torch.zeros(numel, dtype=torch.bool, device=values.device)
    flat = _flat_float32(values)
    inner = selection.top_cut(flat, first) if first > 0 else None
    outer = selection.top_cut(flat, stop) if stop < numel else selection.Cut(-1, numel)
    return selection.band_mask(flat, inner, outer).to(values.device)


def della_keep_probability(owned: torch.Tensor, density: float, epsilon: float) -> torch.Tensor:
    """DELLA's MagPrune keep probability: along each row (dim 1; a 1-D tensor is one row) the entry of ascending
    magnitude rank r of n gets ``density - epsilon + 2 * epsilon * r / (n - 1)``. Equal magnitudes rank by position
    (mergekit's argsort is unstable there). A row of one entry gets ``density`` (mergekit fails on it: 0/0)."""
    rows = owned.unsqueeze(0) if owned.dim() < 2 else owned
    # int32 bit patterns of the magnitudes: the same order as the floats, and torch sorts them ~1.4-3x faster
    magnitude = selection.magnitude_keys(rows.float()).movedim(1, -1)  # float(): exact for half dtypes
    length = magnitude.shape[-1]
    order = torch.argsort(magnitude, dim=-1, stable=True)
    del magnitude
    ranks = torch.empty(order.shape, dtype=torch.float32, device=owned.device)
    positions = torch.arange(length, dtype=torch.float32, device=owned.device).expand(order.shape)
    ranks.scatter_(-1, order, positions)
    del order, positions
    if length > 1:
        ranks.div_(length - 1)
    else:
        ranks.fill_(0.5)
    probability = ranks.mul_(2).mul_(epsilon).add_(density - epsilon)
    return probability.movedim(-1, 1).reshape(owned.shape)


def della_prune_(
    owned: torch.Tensor, density: float, epsilon: float, generator: torch.Generator, rescale: bool = True
) -> torch.Tensor:
    """DELLA MagPrune: magnitude-ranked Bernoulli pruning (see :func:`della_keep_probability`); density >= 1 is
    untouched and density <= 0 all zero, both without drawing. Otherwise density ± epsilon must lie strictly
    inside (0, 1), mergekit's rule."""
    if density >= 1:
        return owned
    if density <= 0:
        return owned.zero_()
    if density + epsilon >= 1 or density - epsilon <= 0:
        raise InvalidParameterError(
            "epsilon", f"density ± epsilon must lie strictly between 0 and 1 (density={density}, epsilon={epsilon})"
        )
    before = _l1(owned, rescale)
    if owned.dtype == torch.float32 and owned.device.type == "cpu" and owned.is_contiguous() and owned.dim() <= 2:
        _della_keep_blocked_(owned.view(1, -1) if owned.dim() < 2 else owned, density, epsilon, generator)
    else:
        _draw_keep_(owned, della_keep_probability(owned, density, epsilon), generator)
    return _rescale_l1_(owned, before) if rescale else owned


# Elements of whole rows (at least) ranked, drawn and masked at a time: the temporaries stay in cache, and it is
# torch's grain size, from which its CPU sort of a 1-D integer tensor is a radix sort.
DELLA_BLOCK = 32768


def _rank_probabilities(length: int, density: float, epsilon: float) -> torch.Tensor:
    """The keep probability of each ascending rank 0..length-1, by the same float32 ops as
    :func:`della_keep_probability` applies to the ranks (so the same bits)."""
    ranks = torch.arange(length, dtype=torch.float32)
    if length > 1:
        ranks.div_(length - 1)
    else:
        ranks.fill_(0.5)
    return ranks.mul_(2).mul_(epsilon).add_(density - epsilon)


def _della_keep_blocked_(rows: torch.Tensor, density: float, epsilon: float, generator: torch.Generator) -> None:
    """:func:`_draw_keep_` with :func:`della_keep_probability`, bit for bit, on a contiguous float32 CPU matrix,
    a block of whole rows at a time (WHY: the full-size rank, probability and int64 order tensors were 5 passes
    over memory and most of DELLA's peak memory).

    A block is ranked by two stable sorts, least significant key first (an LSD radix sort built from torch's):
    the int32 magnitude keys of the whole block, then the row of each entry in that order. The result lists the
    block row after row, each row by ascending magnitude, equal magnitudes by column: each row's stable order, so
    the rank of the entry at sorted position ``i`` is ``i`` minus its row's start. WHY two narrow sorts and not one
    sort of ``row | magnitude | column`` int64 keys (the former way) or a sort per row: torch sorts a 1-D integer
    tensor of at least ``DELLA_BLOCK`` (its grain size) elements by radix, one pass per key byte whatever the
    values, so 4 passes of int32 plus 1 of uint8 rows replace 8 of int64 (-40 % CPU for the ranking, which was
    most of DELLA's time), and a per-row sort is a comparison sort. An entry is kept when its draw is below its
    probability: ``sign(relu(p - u))`` is that test as a float 1 or +0, and multiplying by it is what multiplying
    by the bool mask does (float ops: bool ones were several times slower)."""
    length = rows.shape[1]
    per_block = max(1, -(-DELLA_BLOCK // length))
    # one radix pass for up to 256 rows a block; short rows (length < 128, rare) need wider row ids
    row_type = torch.uint8 if per_block <= 256 else torch.int32
    row_of = torch.arange(per_block, dtype=row_type).repeat_interleave(length)  # row of each block position
    table = _rank_probabilities(length, density, epsilon).repeat(per_block)  # each row's ranks, row after row
    # One set of buffers for every block (WHY: fresh tensors of this size cost their page faults on every block;
    # reused, the copies and abs of a 24.5M-element delta went from 0.22 to 0.08 CPU s).
    capacity = per_block * length
    magnitudes = torch.empty(capacity, dtype=torch.float32)
    sorted_magnitudes = torch.empty(capacity, dtype=torch.int32)
    by_magnitude, by_row, order = (torch.empty(capacity, dtype=torch.int64) for _ in range(3))
    rows_by_magnitude, sorted_rows = (torch.empty(capacity, dtype=row_type) for _ in range(2))
    probability, draws = (torch.empty(capacity, dtype=torch.float32) for _ in range(2))
    for first in range(0, rows.shape[0], per_block):
        block = rows[first : first + per_block]
        numel = block.numel()
        magnitude = selection.magnitude_keys(block, out=magnitudes[:numel].view(block.shape)).view(-1)
        torch.sort(magnitude, stable=True, out=(sorted_magnitudes[:numel], by_magnitude[:numel]))
        torch.index_select(row_of[:numel], 0, by_magnitude[:numel], out=rows_by_magnitude[:numel])
        torch.sort(rows_by_magnitude[:numel], stable=True, out=(sorted_rows[:numel], by_row[:numel]))
        torch.index_select(by_magnitude[:numel], 0, by_row[:numel], out=order[:numel])
        # every position gets one rank's probability: order is a permutation of the block
        keep_probability = probability[:numel].scatter_(0, order[:numel], table[:numel]).view(block.shape)
        uniform_draws = torch.rand(numel, generator=generator, out=draws[:numel]).view(block.shape)
        block.mul_(_below_as_float_(keep_probability.sub_(uniform_draws)))
