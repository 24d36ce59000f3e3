"""Iso-C and Iso-CTS, isotropic merging (Marczak et al., ICML 2025, "No Task Left Behind",
https://arxiv.org/abs/2502.04959).

Iso-C: per weight matrix, the sum of the task matrices ``M = sum_i Delta_i = U S V^T`` keeps its singular vectors
and gets a flat spectrum, ``lambda * mean(S) * U V^T``, so that no task's directions dominate the others'.

Iso-CTS: the top ``k_c`` directions of ``M`` (the common subspace, ``k_c`` about ``common_fraction * min(m, n)``)
are completed by each task's own top directions once the common subspace is projected out of its task matrix
(``Delta_i - U_c U_c^T Delta_i``), ``(min(m, n) - k_c) / T`` per task; left and right vectors are orthogonalised
(polar factors) and the spectrum set flat at the mean of the common singular values.

Choices where the paper is silent: ``k_c = int(common_fraction * min(m, n))``, then, as in the paper's code, the
task-specific total is rounded to a multiple of T and ``k_c`` takes the rest (kept at least 1); the kernel sees no
tensor names, so every 2-D tensor (embeddings included) is merged as a matrix; a tensor that is not 2-D gets the
mean of the task vectors (the paper's code); directions with a numerically zero singular value are dropped (their
vectors are arbitrary) and the mean is over the remaining values (for a full-rank sum, the paper's formula);
``weight`` scales a task vector (default 1, as in the paper).
"""

from __future__ import annotations

import torch

from kernels.subspace import finish, mean_delta, polar, ranked_svd, weighted_deltas
from kernels.task_arithmetic import split_base


def _total(deltas: list[torch.Tensor]) -> torch.Tensor:
    total = deltas[0].clone()
    for delta in deltas[1:]:
        total.add_(delta)
    return total


def iso_c_delta(deltas: list[torch.Tensor]) -> torch.Tensor:
    """``mean(S) * U V^T`` of the summed task matrices (float64)."""
    u, s, vh = ranked_svd(_total(deltas))
    if s.numel() == 0:
        return torch.zeros_like(deltas[0])
    return s.mean() * (u @ vh)


def subspace_sizes(shape: tuple[int, ...], tasks: int, common_fraction: float) -> tuple[int, int]:
    """``(k_c, per-task k)``: the common rank and each task's specific rank, ``k_c + T * k <= min(m, n)``."""
    full = min(shape)
    common = int(full * common_fraction)
    per_task = round((full - common) / tasks)
    per_task = min(per_task, (full - 1) // tasks)  # leave the common subspace at least one direction
    return full - per_task * tasks, per_task


def iso_cts_delta(deltas: list[torch.Tensor], common_fraction: float) -> torch.Tensor:
    """Common plus task-specific directions, orthogonalised, with the flat spectrum of the common ones (float64)."""
    common_k, per_task = subspace_sizes(tuple(deltas[0].shape), len(deltas), common_fraction)
    u, s, vh = ranked_svd(_total(deltas))
    u_c, s_c, vh_c = u[:, :common_k], s[:common_k], vh[:common_k]
    if s_c.numel() == 0:
        return torch.zeros_like(deltas[0])
    us, vhs = [u_c], [vh_c]
    if per_task:
        for delta in deltas:
            specific = delta - u_c @ (u_c.T @ delta)
            u_t, _, vh_t = ranked_svd(specific)
            us.append(u_t[:, :per_task])
            vhs.append(vh_t[:per_task])
    u_perp = polar(torch.cat(us, dim=1))
    vh_perp = polar(torch.cat(vhs, dim=0).T).T
    return s_c.mean() * (u_perp @ vh_perp)


def _merge(tensors, base_index, global_params, model_params, matrix_delta):
    base, others, params = split_base(tensors, base_index, model_params)
    if not others:
        return base.to(torch.float32).clone()
    deltas = weighted_deltas(base, others, params)
    merged = matrix_delta(deltas) if base.dim() == 2 else mean_delta(deltas)
    return finish(base, merged, float(global_params["lambda"]))


def merge_iso_c(tensors, base_index, global_params, model_params, generator, owned=False):
    return _merge(tensors, base_index, global_params, model_params, iso_c_delta)


def merge_iso_cts(tensors, base_index, global_params, model_params, generator, owned=False):
    fraction = float(global_params["common_fraction"])
    return _merge(tensors, base_index, global_params, model_params, lambda d: iso_cts_delta(d, fraction))
