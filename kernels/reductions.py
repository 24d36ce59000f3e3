"""Reductions whose float result does not depend on torch's thread count.

torch splits a full reduction (``x.sum()``) between its intra-op threads, so the rounding of the result can change
with ``torch.set_num_threads``. Merges must be bit-identical whatever the thread count, so full sums are taken over
fixed-size rows (each row reduced by one thread, in float64) and the row sums are then added in a fixed order.
Work is done in chunks so that the float64 scratch stays small for embedding-sized tensors.
"""

from __future__ import annotations

import threading
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


def _scratch(numel: int, like: torch.Tensor) -> torch.Tensor:
    """A float64 buffer for one chunk, reused for every chunk of a call. WHY: a fresh multi-MB tensor per chunk
    costs its page faults every time (the allocator hands such blocks back to the OS); reusing one made an L1 norm
    of 24.5M floats ~10x cheaper (0.09 -> 0.009 s)."""
    return torch.empty(min(numel, CHUNK), dtype=torch.float64, device=like.device)


_kept = threading.local()


def _thread_scratch(count: int, numel: int, like: torch.Tensor) -> list[torch.Tensor]:
    """``count`` one-chunk float64 buffers for a call of :func:`_chunked`; on the CPU this thread's own, kept for
    its next call (calls do not nest). WHY: a merge takes a norm or a dot of every delta, and fresh 8 MB buffers
    per call were half of SCE's page faults (470k of 900k over four 0.4 GB models)."""
    if like.device.type != "cpu":
        return [_scratch(numel, like) for _ in range(count)]
    buffers: list[torch.Tensor] = getattr(_kept, "buffers", [])
    while len(buffers) < count:
        buffers.append(torch.empty(CHUNK, dtype=torch.float64))
    _kept.buffers = buffers
    return [buffer[: min(numel, CHUNK)] for buffer in buffers[:count]]


def _chunked(flat_inputs: list[torch.Tensor], combine: Callable[..., torch.Tensor]) -> torch.Tensor:
    """Fixed-order total of ``combine`` over float64 copies of the inputs, a chunk at a time. ``combine`` may work
    in place on its arguments: they are this call's scratch buffers, never the inputs."""
    numel = flat_inputs[0].numel()
    if numel == 0:
        return torch.zeros((), dtype=torch.float64, device=flat_inputs[0].device)
    scratch = _thread_scratch(len(flat_inputs), numel, flat_inputs[0])
    partials = []
    for start in range(0, numel, CHUNK):
        stop = min(numel, start + CHUNK)
        pieces = [buffer[: stop - start].copy_(x[start:stop]) for x, buffer in zip(flat_inputs, scratch)]
        partials.append(_row_sums(combine(*pieces)))
    return _fixed_order_total(torch.cat(partials))


def stable_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum of all elements of ``x`` in float64, in a fixed association order."""
    return _chunked([x.reshape(-1)], lambda a: a)


def stable_abs_sum(x: torch.Tensor) -> torch.Tensor:
    """L1 norm of ``x`` in float64, in a fixed association order, without a full-size ``abs`` temporary."""
    return _chunked([x.reshape(-1)], torch.abs_)


class GramSums:
    """:func:`stable_gram` fed piece by piece (a tensor streamed from disk): pieces cut at multiples of ``CHUNK``
    elements (only the last may be shorter) give the very bits :func:`stable_gram` gives on the whole, because the
    per-row partials and their fixed-order total are the same."""

    def __init__(self) -> None:
        self._partials: tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]] = ([], [], [])
        self._ragged = False  # a piece shorter than a multiple of CHUNK was added: it must be the last
        # float64 x, y and product chunks, kept for every piece. WHY: fresh ones per piece (3 x 8 MB) cost their
        # page faults on every piece of a streamed slerp, 3x the time of the same tensor merged whole.
        self._buffers: list[torch.Tensor] = []

    def add(self, a: torch.Tensor, b: torch.Tensor) -> None:
        if self._ragged:
            raise ValueError("only the last piece may end off a CHUNK boundary")
        flat_a, flat_b = a.reshape(-1), b.reshape(-1)
        numel = flat_a.numel()
        self._ragged = numel % CHUNK != 0
        if numel == 0:
            return
        if not self._buffers or self._buffers[0].numel() < min(numel, CHUNK):
            self._buffers = [_scratch(numel, flat_a) for _ in range(3)]
        x_buffer, y_buffer, product_buffer = self._buffers
        for start in range(0, numel, CHUNK):
            stop = min(numel, start + CHUNK)
            x = x_buffer[: stop - start].copy_(flat_a[start:stop])
            y = y_buffer[: stop - start].copy_(flat_b[start:stop])
            product = product_buffer[: stop - start]
            for bucket, (left, right) in zip(self._partials, ((x, x), (y, y), (x, y))):
                bucket.append(_row_sums(torch.mul(left, right, out=product)))

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
    return _chunked([a.reshape(-1), b.reshape(-1)], torch.Tensor.mul_)
