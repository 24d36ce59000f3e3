"""Shared linear algebra of the data-free subspace merges (:mod:`kernels.tsv`, :mod:`kernels.iso`): weighted task
matrices, a numerically-ranked SVD and the polar (whitening) factor of a set of directions.

Everything is computed in float64 and returned as float64: the merges chain several SVDs, and float64 keeps the
float32 result stable (and, in practice, the same bits whatever the thread count).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

# Singular values below RANK_RTOL * largest * max(m, n) count as zero: their singular vectors are arbitrary
# (LAPACK picks any orthonormal completion), so a merge that kept them would add made-up directions.
RANK_RTOL = torch.finfo(torch.float32).eps


def weighted_deltas(
    base: torch.Tensor, models: Sequence[torch.Tensor], model_params: Sequence[Mapping[str, Any]]
) -> list[torch.Tensor]:
    """``w_i * (x_i - base)`` in float64, one per non-base model (``weight`` defaults to 1)."""
    base64 = base.to(torch.float64)
    return [(m.to(torch.float64) - base64).mul_(float(p.get("weight", 1.0))) for m, p in zip(models, model_params)]


def ranked_svd(matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Thin SVD ``U, S, Vh`` cut to the numerical rank (singular values above :data:`RANK_RTOL`)."""
    u, s, vh = torch.linalg.svd(matrix, full_matrices=False)
    if s.numel() == 0 or s[0] == 0:
        return u[:, :0], s[:0], vh[:0]
    keep = int((s > s[0] * RANK_RTOL * max(matrix.shape)).sum())
    return u[:, :keep], s[:keep], vh[:keep]


def polar(columns: torch.Tensor) -> torch.Tensor:
    """The orthonormal matrix nearest to ``columns`` (Frobenius): ``P Q^T`` of its thin SVD ``P Σ Q^T``. Columns
    that are already orthonormal come back unchanged; nearly parallel ones are pushed apart (TSV's whitening).
    Rank-deficient ``columns`` have no unique polar factor (the null part of ``P`` is arbitrary): only the
    directions of non-zero singular values are kept (a partial isometry), so the result is well defined."""
    if columns.shape[1] == 0:
        return columns
    p, _, qh = ranked_svd(columns)
    return p @ qh


def mean_delta(deltas: Sequence[torch.Tensor]) -> torch.Tensor:
    """The mean of the (weighted) task vectors: what TSV-M and Iso-C/CTS do with a tensor that is not a matrix
    (biases, norms), as both papers' reference code does."""
    total = deltas[0].clone()
    for delta in deltas[1:]:
        total.add_(delta)
    return total.div_(len(deltas))


def finish(base: torch.Tensor, merged_delta: torch.Tensor, lam: float) -> torch.Tensor:
    """``base + lambda * merged_delta`` as float32."""
    return (base.to(torch.float64) + lam * merged_delta).to(torch.float32)
