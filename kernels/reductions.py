"""Reductions whose float result does not depend on torch's thread count.

torch splits a full reduction (``x.sum()``) between its intra-op threads, so the rounding of the result can change
with ``torch.set_num_threads``. Merges must be bit-identical whatever the thread count, so full sums are taken over
fixed-size rows (each row reduced by one thread, in float64) and the row sums are then added in a fixed order.
Work is done in chunks so that the float64 scratch stays small for embedding-sized tensors.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

ROW = 4096  # below torch's parallel grain size, so one row is always reduced by a single thread
CHUNK = 256 * ROW  # elements converted to float64 at a time


def _row_sums(flat: torch.Tensor) -> torch.Tensor:
    full = (flat.numel() // ROW) * ROW
    parts = [flat[:full].view(-1, ROW).sum(dim=1)] if full else []
    if full < flat.numel():
        parts.append(flat[full:].sum().reshape(1))
    return torch.cat(parts) if parts else flat.new_zeros(1)


def _fixed_order_total(partials: torch.Tensor) -> torch.Tensor:
    while partials.numel() > ROW:
        partials = _row_sums(partials)
    return partials.sum()


def _chunked(flat_inputs: list[torch.Tensor], combine: Callable[..., torch.Tensor]) -> torch.Tensor:
    numel = flat_inputs[0].numel()
    partials = []
    for start in range(0, numel, CHUNK):
        pieces = [x[start : start + CHUNK].to(torch.float64) for x in flat_inputs]
        partials.append(_row_sums(combine(*pieces)))
    if not partials:
        return torch.zeros((), dtype=torch.float64, device=flat_inputs[0].device)
    return _fixed_order_total(torch.cat(partials))


def stable_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum of all elements of ``x`` in float64, in a fixed association order."""
    return _chunked([x.reshape(-1)], lambda a: a)


def stable_abs_sum(x: torch.Tensor) -> torch.Tensor:
    """L1 norm of ``x`` in float64, in a fixed association order, without a full-size ``abs`` temporary."""
    return _chunked([x.reshape(-1)], lambda a: a.abs())


class GramSums:
    """:func:`stable_gram` fed piece by piece (a tensor streamed from disk): pieces cut at multiples of ``CHUNK``
    elements (only the last may be shorter) give the very bits :func:`stable_gram` gives on the whole, because the
    per-row partials and their fixed-order total are the same."""

    def __init__(self) -> None:
        self._partials: tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]] = ([], [], [])
        self._ragged = False  # a piece shorter than a multiple of CHUNK was added: it must be the last

    def add(self, a: torch.Tensor, b: torch.Tensor) -> None:
        if self._ragged:
            raise ValueError("only the last piece may end off a CHUNK boundary")
        flat_a, flat_b = a.reshape(-1), b.reshape(-1)
        self._ragged = flat_a.numel() % CHUNK != 0
        for start in range(0, flat_a.numel(), CHUNK):
            x = flat_a[start : start + CHUNK].to(torch.float64)
            y = flat_b[start : start + CHUNK].to(torch.float64)
            for bucket, product in zip(self._partials, (x * x, y * y, x * y)):
                bucket.append(_row_sums(product))

    def totals(self) -> tuple[float, float, float]:
        """``(a·a, b·b, a·b)`` over every piece added."""
        if not self._partials[0]:
            return 0.0, 0.0, 0.0
        aa, bb, ab = (float(_fixed_order_total(torch.cat(bucket))) for bucket in self._partials)
        return aa, bb, ab


def stable_gram(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float, float]:
    """``(a·a, b·b, a·b)`` in one pass over the data (each chunk converted to float64 once)."""
    sums = GramSums()
    sums.add(a, b)
    return sums.totals()


def stable_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Dot product of two same-sized tensors (flattened) in float64, thread-count independent."""
    return _chunked([a.reshape(-1), b.reshape(-1)], lambda x, y: x * y)
