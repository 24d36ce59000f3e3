"""Spherical linear interpolation between two tensors, treated as flat vectors (mergekit's slerp).

The result is ``c0 * v0 + c1 * v1`` with two scalars from the whole tensors' gram sums, so it can also be computed
in two passes over pieces of the tensors (:func:`streamed_coefficients`, then :func:`blend` piece by piece): an
elementwise result needs no more than a piece in memory, and the bits are the same as the whole tensor's.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from kernels.reductions import GramSums, stable_gram

DOT_THRESHOLD = 0.9995  # above this |cos|, the vectors are (anti-)parallel and slerp degenerates to lerp
EPS = 1e-8


def coefficients(gram: tuple[float, float, float], t: float) -> tuple[float, float]:
    """``(c0, c1)`` from ``(v0·v0, v1·v1, v0·v1)``."""
    squared0, squared1, cross = gram
    norm0 = math.sqrt(squared0)
    norm1 = math.sqrt(squared1)
    # Normalising by a (near-)zero norm would blow up; such a vector is used as is (mergekit's rule).
    norm0 = norm0 if norm0 > EPS else 1.0
    norm1 = norm1 if norm1 > EPS else 1.0
    dot = cross / (norm0 * norm1)
    dot = min(1.0, max(-1.0, dot))
    if abs(dot) > DOT_THRESHOLD:
        return 1.0 - t, t
    theta = math.acos(dot)
    sin_theta = math.sin(theta)
    return math.sin((1.0 - t) * theta) / sin_theta, math.sin(t * theta) / sin_theta


def slerp_coefficients(v0: torch.Tensor, v1: torch.Tensor, t: float) -> tuple[float, float]:
    """``(c0, c1)`` with ``slerp(v0, v1, t) = c0 * v0 + c1 * v1``."""
    return coefficients(stable_gram(v0, v1), t)


def streamed_coefficients(pieces: Iterable[tuple[torch.Tensor, torch.Tensor]], t: float) -> tuple[float, float]:
    """:func:`slerp_coefficients` of two tensors given as float32 piece pairs in order, each cut at a multiple of
    :data:`kernels.reductions.CHUNK` elements (the last may be shorter): the same bits."""
    sums = GramSums()
    for piece0, piece1 in pieces:
        sums.add(piece0, piece1)
    return coefficients(sums.totals(), t)


def blend(v0: torch.Tensor, v1: torch.Tensor, c0: float, c1: float, in_place: bool = False) -> torch.Tensor:
    """``c0 * v0 + c1 * v1`` for float32 ``v0``, ``v1``; with ``in_place`` written into ``v0`` (no third tensor).
    The same two elementwise float32 ops either way, so the same bits."""
    out = v0.mul_(c0) if in_place else v0 * c0
    return out.add_(v1, alpha=c1)


def slerp(v0: torch.Tensor, v1: torch.Tensor, t: float, owned: bool = False) -> torch.Tensor:
    """``v0`` at ``t = 0``, ``v1`` at ``t = 1``; float32 result. With ``owned`` (the caller gives the inputs up)
    the result is written into ``v0``'s float32 buffer."""
    a = v0.to(torch.float32)
    b = v1.to(torch.float32)
    c0, c1 = slerp_coefficients(a, b, t)
    # A converted copy of v0 is ours whatever ``owned`` says; never write into memory v1 reads.
    in_place = (owned or a is not v0) and a.data_ptr() != b.data_ptr()
    return blend(a, b, c0, c1, in_place)


def merge(tensors, base_index, global_params, model_params, generator, owned=False):
    base = tensors[base_index]
    other = tensors[1 - base_index]
    return slerp(base, other, float(global_params["t"]), owned)
