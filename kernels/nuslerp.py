"""NuSLERP (mergekit's nuslerp): spherical interpolation of exactly two models, optionally of their task vectors
relative to a base, over the whole tensor (``nuslerp_flatten``, the default) or row by row.

The interpolation factor comes from the two weights: ``t = w_1 / (w_0 + w_1)`` (0.5 when they sum to ~0).
Row by row: with ``nuslerp_row_wise`` false each slice along the last dimension is one vector (rows of a matrix),
with it true each slice along dimension 0 (columns): mergekit's naming, kept as is.
"""

from __future__ import annotations

import torch

from kernels.task_arithmetic import task_vector

NORM_FLOOR = 1e-7  # a vector shorter than this is divided by it instead of its norm
COLINEAR_EPS = 1e-8  # 1 - cos^2 <= eps^2: (anti-)parallel, interpolate linearly
WEIGHT_SUM_EPS = 1e-6


def interpolation_factor(weight0: float, weight1: float) -> float:
    total = weight0 + weight1
    return 0.5 if abs(total) < WEIGHT_SUM_EPS else weight1 / total


def _unit(x: torch.Tensor) -> torch.Tensor:
    return x / torch.linalg.vector_norm(x, dim=-1, keepdim=True).clamp(min=NORM_FLOOR)


def nuslerp(
    t: float,
    v0: torch.Tensor,
    v1: torch.Tensor,
    *,
    row_wise: bool = False,
    flatten: bool = True,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``v0`` at ``t = 0``, ``v1`` at ``t = 1``; a result of ``v0``'s shape computed in ``dtype`` (float32, or a
    recipe's half dtype, every step in it as mergekit computes it)."""
    shape = v0.shape
    v0, v1 = v0.to(dtype), v1.to(dtype)
    if flatten:
        v0, v1 = v0.reshape(-1), v1.reshape(-1)
    elif row_wise:
        v0, v1 = v0.transpose(0, -1), v1.transpose(0, -1)
    cos = (_unit(v0) * _unit(v1)).sum(dim=-1, keepdim=True).clamp(-1, 1)
    colinear = (1 - cos.square()) <= COLINEAR_EPS**2
    theta = torch.acos(torch.where(colinear, 0, cos))
    sin_theta = torch.sin(theta)
    spherical = (torch.sin((1 - t) * theta) * v0 + torch.sin(t * theta) * v1) / sin_theta
    out = torch.where(colinear, (1 - t) * v0 + t * v1, spherical)
    if row_wise and not flatten:
        out = out.transpose(0, -1)
    return out.reshape(shape)


def merge(tensors, base_index, global_params, model_params, generator, owned=False, dtype=torch.float32):
    others = [i for i in range(len(tensors)) if i != base_index]
    if len(others) != 2:
        raise ValueError(f"nuslerp needs exactly two models besides the base, got {len(others)}")
    t = interpolation_factor(float(model_params[others[0]]["weight"]), float(model_params[others[1]]["weight"]))
    options = dict(
        row_wise=bool(global_params["nuslerp_row_wise"]), flatten=bool(global_params["nuslerp_flatten"]), dtype=dtype
    )
    a, b = (tensors[i] for i in others)
    if base_index is None:
        return nuslerp(t, a, b, **options)
    base = tensors[base_index]
    deltas = task_vector(a, base, owned, dtype), task_vector(b, base, owned, dtype)
    return nuslerp(t, *deltas, **options).add_(base.to(dtype))
