"""Exact top-m selection by magnitude, in linear time, without sorting and without a full-size scratch copy.

Order: entries are ranked by magnitude, largest first; of equal magnitudes the earlier position ranks higher.
The top ``m`` entries are then described by a :class:`Cut`: every entry whose magnitude is above ``key``, plus the
entries equal to ``key`` at positions before ``tie_end``. (Exactly the set the former ``torch.kthvalue`` kernel
kept, computed without its full copy and quickselect passes, which made TIES 4.3x slower than task arithmetic.)

Magnitudes are compared as the int32 bit patterns of ``|x|``: for non-negative floats (denormals, +-0, inf
included) the bit pattern orders exactly as the value, and -0 becomes +0 under ``abs``. NaN ranks above inf.

How the threshold is found (all counts are integers, so the result never depends on torch's thread count):

1. a fixed pseudo-random sample of the keys (seeded, so the same tensor always gives the same sample) brackets
   the m-th largest key between ``low`` and ``high`` with a wide margin;
2. one chunked pass counts the keys above ``high`` and gathers the keys inside the bracket (a few percent; for a
   small m, every key at or above ``low``, uncounted);
3. the exact key is the right order statistic of that small band (``kthvalue``).

When the bracket misses (or the band would be large: heavy ties), an exact two-level radix histogram of the bits
(high 16 bits, then low 16 bits of the chosen bucket) finds the key instead. Chunks are small enough to stay in
the CPU cache, which is most of the speed: every pass over a chunk after the first reads it from cache.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from kernels.pieces import PIECE

CHUNK = PIECE  # elements per piece: cache-resident across the per-piece passes (kernels.pieces)
HISTOGRAM_CHUNK = 1 << 20  # larger pieces for the radix path: each bincount clears and adds up to 2**16 bins
SAMPLE = 1 << 16  # keys drawn to bracket the threshold
SAMPLE_SEED = 0x5E1EC7  # fixed: the sample (hence only the speed, never the result) is a function of the tensor
MARGIN_SIGMAS = 5.0  # bracket half-width in binomial standard deviations of the sampled rank
BAND_LIMIT = 1 / 16  # a band holding more than this fraction of the entries goes to the radix histogram
TOP_ONLY = 1 / 32  # keeping at most this fraction, the band is every key above the bracket's low end (_banded)
# tensors (and bands) this small are selected directly with kthvalue: measured on int32 keys, kthvalue took 0.85 ms
# for 65,536 keys against 2.6 ms by sampled band, 3.5 against 4.0 for 262,144 and 7.5 against 4.0 for 500,000
DIRECT_LIMIT = 1 << 18
HIGH_BINS = 1 << 15  # keys are < 2**31: the high 16 bits take 2**15 values
LOW_BINS = 1 << 16


@dataclass(frozen=True)
class Cut:
    """The top-m set: keys > ``key``, and keys == ``key`` at flat positions < ``tie_end``."""

    key: int
    tie_end: int


def magnitude_keys(piece: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """int32 keys ordered as the magnitudes of the float32 ``piece`` (a new tensor, or written into the float32
    ``out``)."""
    return torch.abs(piece, out=out).view(torch.int32)


def _chunks(numel: int, size: int = CHUNK):
    for start in range(0, numel, size):
        yield start, min(numel, start + size)


# --- finding the m-th largest key ------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Order:
    """The m-th largest key, how many keys are above it and how many equal it; ``band``, when the key was found in
    a band of keys (every key equal to it is in the band): ``(piece start, its in-band keys in position order)`` for
    each piece, so the ties can be located without another pass over the tensor."""

    key: int
    above: int
    equal: int
    band: list[tuple[int, torch.Tensor]] | None = field(default=None, compare=False, repr=False)


def _identity(keys: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    return keys


def _direct(source: torch.Tensor, m: int, keys_of) -> _Order:
    keys = keys_of(source)
    key = int(torch.kthvalue(keys, keys.numel() - m + 1).values)
    return _Order(key, int(torch.count_nonzero(keys > key)), int(torch.count_nonzero(keys == key)))


def _bracket(source: torch.Tensor, m: int, keys_of) -> tuple[int, int]:
    """Keys ``(low, high)`` that hold the m-th largest key with overwhelming probability."""
    numel = source.numel()
    generator = torch.Generator().manual_seed(SAMPLE_SEED)
    positions = torch.randint(numel, (SAMPLE,), generator=generator)
    sample = keys_of(source[positions])
    fraction = m / numel  # share of entries at or above the m-th largest
    margin = MARGIN_SIGMAS * math.sqrt(SAMPLE * fraction * (1 - fraction)) + 8
    from_top = SAMPLE * fraction
    # ascending 1-based ranks of the bracket's keys in the sample (kthvalue: a sort of the sample is slower)
    high_rank = SAMPLE - math.floor(from_top - margin)
    low_rank = SAMPLE - math.ceil(from_top + margin)
    high = int(torch.kthvalue(sample, high_rank).values) if high_rank < SAMPLE else torch.iinfo(torch.int32).max
    low = int(torch.kthvalue(sample, low_rank).values) if low_rank > 1 else 0
    return low, high


def _banded(source: torch.Tensor, m: int, keys_of) -> _Order | None:
    """The m-th largest key, found inside the band of keys between the sample's bracket (itself selected the same
    way); None when the bracket missed or the band grew past BAND_LIMIT. For a small m (``m <= numel *
    TOP_ONLY``) the band is every key at or above the bracket's low end: the m largest are among them, so no key
    is compared with the high end nor counted above it (WHY: those were a third of the pass; Model Breadcrumbs
    cuts its top 1 % so on every tensor)."""
    low, high = _bracket(source, m, keys_of)
    if low == high:  # the sample sees one key around the threshold (heavy ties, e.g. an all-zero task vector)
        return _counted(source, m, keys_of, high)
    top_only = m <= source.numel() * TOP_ONLY
    limit = max(DIRECT_LIMIT, int(source.numel() * BAND_LIMIT))
    above, band, banded = 0, [], 0
    # one set of piece buffers for the whole pass (WHY: a fresh 512 KB key tensor per piece cost its page faults,
    # a fifth of the pass)
    size = min(CHUNK, source.numel())
    keys_buffer = torch.empty(size, dtype=torch.float32)
    over_buffer, inside_buffer = (torch.empty(size, dtype=torch.bool) for _ in range(2))
    for start, end in _chunks(source.numel()):
        count = end - start
        keys = keys_of(source[start:end], out=keys_buffer[:count])
        inside_mask = torch.ge(keys, low, out=inside_buffer[:count])
        if not top_only:
            over = torch.gt(keys, high, out=over_buffer[:count])
            above += int(torch.count_nonzero(over))
            inside_mask.logical_xor_(over)  # over is a subset of keys >= low
        inside = keys[inside_mask]
        banded += inside.numel()
        if banded > limit:
            return None
        band.append((start, inside))
    if not above < m <= above + banded:
        return None
    within = _order(torch.cat([keys for _, keys in band]), m - above, _identity)
    return _Order(within.key, above + within.above, within.equal, band)


def _counted(source: torch.Tensor, m: int, keys_of, key: int) -> _Order | None:
    """The order if ``key`` is the m-th largest key, found by counting alone; None if it is not."""
    above = equal = 0
    for start, end in _chunks(source.numel()):
        keys = keys_of(source[start:end])
        above += int(torch.count_nonzero(keys > key))
        equal += int(torch.count_nonzero(keys == key))
    return _Order(key, above, equal) if above < m <= above + equal else None


def _histogram(flat: torch.Tensor, bins: int, digit, select=None) -> torch.Tensor:
    counts = torch.zeros(bins, dtype=torch.int64)
    for start, end in _chunks(flat.numel(), HISTOGRAM_CHUNK):
        keys = magnitude_keys(flat[start:end])
        if select is not None:
            keys = keys[select(keys)]
        # int64 digits: torch's bincount of int32 input was measured 10x slower on concentrated values
        counts += torch.bincount(digit(keys).long(), minlength=bins)
    return counts


def _descend(counts: torch.Tensor, m: int) -> tuple[int, int]:
    """The bin holding the m-th largest of the counted keys and the count of keys in higher bins."""
    above_or_in = counts.flip(0).cumsum(0)  # keys in bin >= b, from the top bin down
    from_top = int(torch.searchsorted(above_or_in, m))  # first from-top index whose running count reaches m
    above = int(above_or_in[from_top - 1]) if from_top else 0
    return counts.numel() - 1 - from_top, above


def _radix(flat: torch.Tensor, m: int) -> _Order:
    """Exact two-level radix selection: 16 high bits, then the 16 low bits of the chosen bucket."""
    high = _histogram(flat, HIGH_BINS, lambda k: k >> 16)
    bucket, above_bucket = _descend(high, m)
    low = _histogram(flat, LOW_BINS, lambda k: k & 0xFFFF, select=lambda k: (k >> 16) == bucket)
    digit, above_digit = _descend(low, m - above_bucket)
    return _Order((bucket << 16) | digit, above_bucket + above_digit, int(low[digit]))


def _order(source: torch.Tensor, m: int, keys_of=magnitude_keys) -> _Order:
    """The m-th largest key of ``source`` (float32 entries ranked by magnitude, or int32 keys with _identity)."""
    if source.numel() <= DIRECT_LIMIT:
        return _direct(source, m, keys_of)
    found = _banded(source, m, keys_of)
    if found is not None:
        return found
    return _radix(source if keys_of is magnitude_keys else source.view(torch.float32), m)


def _tie_end(flat: torch.Tensor, order: _Order, wanted: int) -> int:
    """Flat position just past the ``wanted``-th entry whose key equals ``order.key`` (wanted >= 1). With the band
    the key was found in, only the band's keys are counted and one piece is searched."""
    seen = 0
    pieces: Iterable[tuple[int, torch.Tensor | None]] = order.band or [
        (start, None) for start, _ in _chunks(flat.numel())
    ]
    for start, in_band in pieces:
        end = min(flat.numel(), start + CHUNK)
        candidates = magnitude_keys(flat[start:end]) if in_band is None else in_band
        count = int(torch.count_nonzero(candidates == order.key))
        if seen + count >= wanted:
            equal = magnitude_keys(flat[start:end]) == order.key
            return start + int(torch.nonzero(equal)[wanted - seen - 1]) + 1
        seen += count
    raise AssertionError("fewer tied entries than counted")


def top_cut(flat: torch.Tensor, m: int) -> Cut:
    """The cut holding the ``m`` largest magnitudes of the flat float32 ``flat`` (0 < m < numel)."""
    order = _order(flat, m)
    wanted = m - order.above  # tied entries to keep, 1..equal
    if wanted == order.equal:
        return Cut(order.key, flat.numel())
    return Cut(order.key, _tie_end(flat, order, wanted))


# --- applying a cut ---------------------------------------------------------------------------------------------


def _piece_mask(keys: torch.Tensor, cut: Cut, start: int) -> torch.Tensor:
    """Which keys of the piece starting at flat position ``start`` are inside the cut."""
    end = start + keys.numel()
    if cut.tie_end >= end:
        return keys >= cut.key
    if cut.tie_end <= start:
        return keys > cut.key
    mask = keys > cut.key
    split = cut.tie_end - start
    mask[:split] |= keys[:split] == cut.key
    return mask


def cut_mask(flat: torch.Tensor, cut: Cut) -> torch.Tensor:
    """Boolean mask (flat) of the entries inside ``cut``."""
    mask = torch.empty(flat.numel(), dtype=torch.bool)
    for start, end in _chunks(flat.numel()):
        mask[start:end] = _piece_mask(magnitude_keys(flat[start:end]), cut, start)
    return mask


def band_mask(flat: torch.Tensor, inner: Cut | None, outer: Cut) -> torch.Tensor:
    """Entries inside ``outer`` but not inside ``inner`` (None: no inner cut)."""
    mask = torch.empty(flat.numel(), dtype=torch.bool)
    for start, end in _chunks(flat.numel()):
        keys = magnitude_keys(flat[start:end])
        piece = _piece_mask(keys, outer, start)
        if inner is not None:
            piece &= ~_piece_mask(keys, inner, start)
        mask[start:end] = piece
    return mask


INF_KEY = 0x7F800000  # the key of inf; larger keys are NaN


def _key_value(key: int) -> float:
    """The float32 magnitude whose bit pattern is ``key`` (exact as a Python float; struct, not a tensor: this is
    called for every piece)."""
    return struct.unpack("<f", struct.pack("<i", key))[0]


def _shrink_(piece: torch.Tensor, key: int, inclusive: bool) -> None:
    """Zero the entries of ``piece`` whose magnitude is below the ``key`` magnitude (also those equal to it unless
    ``inclusive``). ``hardshrink`` keeps ``|x| > lambd`` in one vectorised float pass, with no bool temporaries."""
    bound = key - 1 if inclusive else key
    if bound < 0:
        return
    torch.hardshrink(piece, _key_value(bound), out=piece)


def keep_cut_(flat: torch.Tensor, cut: Cut) -> torch.Tensor:
    """Zero, in place, every entry outside ``cut`` (zeroed entries become +0)."""
    if cut.key >= INF_KEY:  # inf or NaN threshold: hardshrink cannot express it, compare the keys instead
        for start, end in _chunks(flat.numel()):
            piece = flat[start:end]
            piece.masked_fill_(~_piece_mask(magnitude_keys(piece), cut, start), 0.0)
        return flat
    for start, end in _chunks(flat.numel()):
        _on_tie_sides(flat[start:end], start, cut, _shrink_)
    return flat


def _on_tie_sides(piece: torch.Tensor, start: int, cut: Cut, apply: Callable[[torch.Tensor, int, bool], None]) -> None:
    """``apply(part, cut.key, inclusive)`` to the part of ``piece`` (at flat position ``start``) before the cut's
    ``tie_end``, where entries equal to the key are inside the cut, and to the part after it, where they are not."""
    split = min(max(cut.tie_end - start, 0), piece.numel())
    if split > 0:
        apply(piece[:split], cut.key, True)
    if split < piece.numel():
        apply(piece[split:], cut.key, False)


def _drop_(piece: torch.Tensor, key: int, inclusive: bool) -> None:
    """Zero the entries of the finite ``piece`` whose magnitude is above the ``key`` magnitude (also those equal to
    it when ``inclusive``): ``x - hardshrink(x)`` is +0 where hardshrink keeps x and x where it gives +0."""
    bound = key - 1 if inclusive else key
    if bound < 0:
        piece.zero_()
        return
    piece.sub_(torch.hardshrink(piece, _key_value(bound)))


def drop_cut_(flat: torch.Tensor, cut: Cut) -> torch.Tensor:
    """Zero, in place, every entry inside ``cut`` (zeroed entries become +0): the complement of :func:`keep_cut_`.
    A piece holding inf or NaN (or whose sum overflows) compares the keys instead, since ``inf - inf`` is NaN."""
    for start, end in _chunks(flat.numel()):
        piece = flat[start:end]
        if cut.key >= INF_KEY or not math.isfinite(float(piece.sum())):
            piece.masked_fill_(_piece_mask(magnitude_keys(piece), cut, start), 0.0)
        else:
            _on_tie_sides(piece, start, cut, _drop_)
    return flat
