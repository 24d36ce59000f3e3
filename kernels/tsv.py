"""TSV-M, Task Singular Vectors merge (Gargiulo et al., CVPR 2025, https://arxiv.org/abs/2412.00081).

Per weight matrix, each task matrix ``Delta_i = U_i S_i V_i^T`` keeps its top ``k`` singular triplets, with
``k = floor(rank_fraction * min(m, n) / T)`` (at least 1) for ``T`` task vectors: by default the T tasks share the
rank equally. The kept left vectors of every task are concatenated, ``U = [U_1,k .. U_T,k]``, likewise ``V`` and
``S``; ``U`` and ``V`` are whitened (replaced by their polar factors ``P Q^T``, the nearest orthonormal matrices)
so that the tasks stop interfering, and the merged change is ``lambda * U_perp diag(S) V_perp^T``.

Choices where the paper is silent: the kernel sees no tensor names, so every 2-D tensor (embeddings included) is
merged as a matrix; a tensor that is not 2-D (bias, norm, conv) gets the mean of the task vectors, as the paper's
code does; singular triplets whose value is numerically zero are dropped before whitening (their vectors are
arbitrary); ``weight`` scales a task vector before its SVD (default 1, as in the paper).
"""

from __future__ import annotations

import math

import torch

from kernels.subspace import finish, mean_delta, polar, ranked_svd, weighted_deltas
from kernels.task_arithmetic import split_base


def task_rank(shape: tuple[int, ...], tasks: int, rank_fraction: float) -> int:
    """Singular triplets kept per task: ``floor(rank_fraction * min(m, n) / T)``, at least one."""
    return max(1, math.floor(rank_fraction * min(shape) / tasks))


def tsv_delta(deltas: list[torch.Tensor], rank_fraction: float) -> torch.Tensor:
    """The whitened sum of the task matrices' top singular triplets (float64)."""
    k = task_rank(tuple(deltas[0].shape), len(deltas), rank_fraction)
    us, ss, vhs = [], [], []
    for delta in deltas:
        u, s, vh = ranked_svd(delta)
        us.append(u[:, :k])
        ss.append(s[:k])
        vhs.append(vh[:k])
    u_all, s_all, vh_all = torch.cat(us, dim=1), torch.cat(ss), torch.cat(vhs, dim=0)
    if s_all.numel() == 0:  # every task matrix is zero
        return torch.zeros_like(deltas[0])
    u_perp = polar(u_all)
    vh_perp = polar(vh_all.T).T
    return (u_perp * s_all) @ vh_perp


def merge(tensors, base_index, global_params, model_params, generator, owned=False):
    base, others, params = split_base(tensors, base_index, model_params)
    if not others:
        return base.to(torch.float32).clone()
    deltas = weighted_deltas(base, others, params)
    if base.dim() == 2:
        merged = tsv_delta(deltas, float(global_params["rank_fraction"]))
    else:
        merged = mean_delta(deltas)
    return finish(base, merged, float(global_params["lambda"]))
