"""Multi-SLERP (mergekit's multislerp): barycentric interpolation of any number of models on a hypersphere,
optionally of their task vectors relative to a base.

The (task) vectors are normalised, their weighted mean is projected onto the sphere, the weighted mean of the
vectors' tangents there is mapped back with the exponential map, and the result is scaled by the weighted mean of
the norms. Streaming: one accumulator and one pass per model for each reduction instead of a stack of unit copies.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from kernels.errors import InvalidParameterError
from kernels.reductions import stable_dot
from kernels.task_arithmetic import task_vector


def multislerp(
    models: Sequence[torch.Tensor],
    weights: Sequence[float],
    base: torch.Tensor | None = None,
    *,
    normalize_weights: bool = True,
    eps: float = 1e-8,
    owned: bool = False,
) -> torch.Tensor:
    if len(models) == 1:  # mergekit returns the model itself, even with a base
        return models[0].to(torch.float32).clone()
    vectors = [task_vector(m, base, owned) if base is not None else m.to(torch.float32) for m in models]
    weights = [float(w) for w in weights]
    if normalize_weights:
        total = float(torch.tensor(weights, dtype=torch.float32).sum())
        if total == 0:
            raise InvalidParameterError("weight", "weights sum to zero, so they cannot be normalized")
        weights = [w / total for w in weights]
    norms = [math.sqrt(float(stable_dot(v, v))) for v in vectors]
    mean = torch.zeros_like(vectors[0])
    for vector, weight, norm in zip(vectors, weights, norms):
        # Divide, then weight, then add (no fused multiply-add): antipodal inputs then cancel exactly, as in mergekit.
        mean.add_(torch.div(vector, norm + eps).mul_(weight))
    mean_norm = math.sqrt(float(stable_dot(mean, mean)))
    if mean_norm < eps:
        if len(vectors) != 2:
            raise InvalidParameterError(
                "weight",
                "the weighted mean of the models' directions is zero (antipodal models with balancing "
                "weights); choose other weights",
            )
        out = vectors[0].mul(weights[0]).add_(vectors[1] * weights[1])  # mergekit's linear fallback
        return out.add_(base.to(torch.float32)) if base is not None else out
    mean.div_(mean_norm)
    # Tangent of unit vector u_i at the mean m: u_i - (u_i . m) m; their weighted sum.
    tangent = torch.zeros_like(mean)
    along_mean = 0.0
    for vector, weight, norm in zip(vectors, weights, norms):
        unit_scale = 1.0 / (norm + eps)
        tangent.add_(vector, alpha=weight * unit_scale)
        along_mean += weight * float(stable_dot(vector, mean)) * unit_scale
    del vectors
    tangent.sub_(mean, alpha=along_mean)
    tangent_norm = math.sqrt(float(stable_dot(tangent, tangent))) + eps
    out = mean.mul_(math.cos(tangent_norm)).add_(tangent, alpha=math.sin(tangent_norm) / tangent_norm)
    out.mul_(sum(n * w for n, w in zip(norms, weights)))
    return out.add_(base.to(torch.float32)) if base is not None else out


def multislerp_in(
    dtype: torch.dtype,
    models: Sequence[torch.Tensor],
    weights: Sequence[float],
    base: torch.Tensor | None = None,
    *,
    normalize_weights: bool = True,
    eps: float = 1e-8,
) -> torch.Tensor:
    """Multi-SLERP with every step in a recipe's half ``dtype``, in mergekit's order of operations (a stack of the
    (task) vectors, a weight tensor of that dtype, reductions of it): what mergekit computes for
    ``dtype: bfloat16``. Not streamed: the parity path."""
    if len(models) == 1:
        return models[0].to(dtype).clone()
    stacked = torch.stack([m.to(dtype) for m in models])
    if base is not None:
        stacked -= base.to(dtype)
    flat = stacked.view(len(models), -1)
    w = torch.tensor([float(x) for x in weights], dtype=dtype)
    if normalize_weights:
        total = w.sum()
        if total == 0:
            raise InvalidParameterError("weight", "weights sum to zero, so they cannot be normalized")
        w = w / total
    norms = torch.linalg.vector_norm(flat, dim=-1, keepdim=True)
    units = flat / (norms + eps)
    mean = (units * w.view(-1, 1)).sum(0)
    mean_norm = torch.linalg.vector_norm(mean)
    if mean_norm < eps:
        if len(models) != 2:
            raise InvalidParameterError("weight", "the weighted mean of the models' directions is zero")
        out = (stacked[0] * w[0] + stacked[1] * w[1]).view(stacked.shape[1:])
        return out + base.to(dtype) if base is not None else out
    mean = mean / mean_norm
    tangents = units - (units * mean).sum(-1, keepdim=True) * mean
    tangent = (tangents * w.view(-1, 1)).sum(0)
    tangent_norm = torch.linalg.vector_norm(tangent) + eps
    out = mean * torch.cos(tangent_norm) + tangent * (torch.sin(tangent_norm) / tangent_norm)
    out = (out * (norms.squeeze(-1) * w).sum()).view(stacked.shape[1:])
    return out + base.to(dtype) if base is not None else out


def merge(tensors, base_index, global_params, model_params, generator, owned=False, dtype=torch.float32):
    others = [i for i in range(len(tensors)) if i != base_index]
    base = tensors[base_index] if base_index is not None else None
    if dtype != torch.float32:
        return multislerp_in(
            dtype,
            [tensors[i] for i in others],
            [model_params[i]["weight"] for i in others],
            base,
            normalize_weights=bool(global_params["normalize_weights"]),
            eps=float(global_params["eps"]),
        )
    return multislerp(
        [tensors[i] for i in others],
        [model_params[i]["weight"] for i in others],
        base,
        normalize_weights=bool(global_params["normalize_weights"]),
        eps=float(global_params["eps"]),
        owned=owned,
    )
