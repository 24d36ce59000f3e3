"""Karcher mean (mergekit's karcher): the equally weighted Riemannian mean of the models' directions on the unit
hypersphere, found by fixed-point iteration, scaled by the mean of the models' norms. No base model.

Streaming: unit vectors are never materialised (``u_i = x_i / |x_i|`` enters every sum as a coefficient), and
dot products and norms are float64 thread-independent reductions (mergekit takes them in float32).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from kernels.reductions import stable_dot


def _norm(x: torch.Tensor) -> float:
    return math.sqrt(float(stable_dot(x, x)))


def karcher(tensors: Sequence[torch.Tensor], max_iter: int = 10, tol: float = 1e-5) -> torch.Tensor:
    tensors = [t.to(torch.float32) for t in tensors]
    if len(tensors) == 1:
        return tensors[0].clone()
    alphas = [1.0 / len(tensors)] * len(tensors)
    norms = [_norm(t) for t in tensors]
    valid = [i for i, norm in enumerate(norms) if norm > tol]
    if not valid:
        return torch.zeros_like(tensors[0])
    alpha_sum = sum(alphas[i] for i in valid)
    weights = {i: alphas[i] / alpha_sum for i in valid}

    mean = torch.zeros_like(tensors[0])
    for i in valid:
        mean.add_(tensors[i], alpha=weights[i] / norms[i])
    mean_norm = _norm(mean)
    if mean_norm < tol:
        mean = tensors[valid[0]] / norms[valid[0]]
    else:
        mean.div_(mean_norm)

    tangent = torch.empty_like(mean)
    for _ in range(int(max_iter)):
        tangent.zero_()
        for i in valid:
            dot = min(1.0, max(-1.0, float(stable_dot(mean, tensors[i])) / norms[i]))
            theta = math.acos(dot)
            if theta < tol:
                continue
            coefficient = weights[i] * theta / math.sin(theta)
            tangent.add_(tensors[i], alpha=coefficient / norms[i]).sub_(mean, alpha=coefficient * dot)
        tangent_norm = _norm(tangent)
        if tangent_norm < tol:
            break
        mean.mul_(math.cos(tangent_norm)).add_(tangent, alpha=math.sin(tangent_norm) / tangent_norm)
        unit_norm = _norm(mean)
        if unit_norm > tol:
            mean.div_(unit_norm)
    return mean.mul_(sum(a * n for a, n in zip(alphas, norms)))


def karcher_in(dtype: torch.dtype, tensors: Sequence[torch.Tensor], max_iter: int = 10, tol: float = 1e-5):
    """The Karcher mean as mergekit computes it for a recipe's half ``dtype``: norms in float32 (0-d tensors, which
    do not promote), unit vectors, the mean, the tangent and every update rounded to ``dtype``, dot products as
    reductions of it. Not streamed: the parity path."""
    tensors = [t.to(dtype) for t in tensors]
    if len(tensors) == 1:
        return tensors[0].clone()
    alphas = [1.0 / len(tensors)] * len(tensors)
    norms = [torch.linalg.vector_norm(t.to(torch.float32)) for t in tensors]
    units = [torch.zeros_like(t) if n.item() == 0.0 else (t / n).to(dtype) for t, n in zip(tensors, norms)]
    valid = [i for i, n in enumerate(norms) if n.item() > tol]
    if not valid:
        return torch.zeros_like(tensors[0])
    alpha_sum = sum(alphas[i] for i in valid)
    weights = [alphas[i] / alpha_sum for i in valid]
    units = [units[i] for i in valid]
    mean = torch.zeros_like(units[0])
    for weight, unit in zip(weights, units):
        mean += weight * unit
    mean_norm = torch.linalg.vector_norm(mean.to(torch.float32))
    mean = units[0].clone() if mean_norm.item() < tol else (mean / mean_norm).to(dtype)
    for _ in range(int(max_iter)):
        tangent = torch.zeros_like(mean)
        for weight, unit in zip(weights, units):
            dot = torch.clamp(torch.dot(mean.flatten(), unit.flatten()), -1.0, 1.0)
            theta = torch.arccos(dot)
            if theta.item() < tol:
                continue
            tangent += weight * (theta / torch.sin(theta)) * (unit - dot * mean)
        tangent_norm = torch.linalg.vector_norm(tangent.to(torch.float32))
        if tangent_norm.item() < tol:
            break
        mean = (torch.cos(tangent_norm) * mean + torch.sin(tangent_norm) * (tangent / tangent_norm)).to(dtype)
        unit_norm = torch.linalg.vector_norm(mean.to(torch.float32))
        if unit_norm.item() > tol:
            mean = (mean / unit_norm).to(dtype)
    scale = sum(a * n for a, n in zip(alphas, norms))
    return scale * mean


def merge(tensors, base_index, global_params, model_params, generator, owned=False, dtype=torch.float32):
    if dtype != torch.float32:
        return karcher_in(dtype, tensors, int(global_params["max_iter"]), float(global_params["tol"]))
    return karcher(tensors, int(global_params["max_iter"]), float(global_params["tol"]))
