"""Spherical linear interpolation between two tensors, treated as flat vectors (mergekit's slerp)."""

from __future__ import annotations

import math

import torch

from kernels.reductions import stable_gram

DOT_THRESHOLD = 0.9995  # above this |cos|, the vectors are (anti-)parallel and slerp degenerates to lerp
EPS = 1e-8


def slerp_coefficients(v0: torch.Tensor, v1: torch.Tensor, t: float) -> tuple[float, float]:
    """``(c0, c1)`` with ``slerp(v0, v1, t) = c0 * v0 + c1 * v1``."""
    squared0, squared1, cross = stable_gram(v0, v1)
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


def slerp(v0: torch.Tensor, v1: torch.Tensor, t: float) -> torch.Tensor:
    """``v0`` at ``t = 0``, ``v1`` at ``t = 1``; float32 result."""
    v0 = v0.to(torch.float32)
    v1 = v1.to(torch.float32)
    c0, c1 = slerp_coefficients(v0, v1, t)
    out = v0 * c0
    out.add_(v1, alpha=c1)
    return out


def merge(tensors, base_index, global_params, model_params, generator, owned=False):
    base = tensors[base_index]
    other = tensors[1 - base_index]
    return slerp(base, other, float(global_params["t"]))
