"""Model Stock (mergekit's model_stock): interpolate between the base and the average of the fine-tuned models by
a factor the angle between their task vectors decides: ``t = N cos / (1 + (N - 1) cos)`` with cos the mean pairwise
cosine of the N task vectors. Over the whole tensor, or per row (``filter_wise``; a 1-D tensor is one row).

Streaming: the pairwise dot products come from one chunked pass in float64; no task vector is kept whole.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kernels.reductions import stable_dot

COSINE_FLOOR = 1e-6  # norm products below this are clamped (mergekit's rule)
SINGULAR = 1e-6  # |1 + (N - 1) cos| below this: no finite estimate, keep the base
ROWS_PER_CHUNK_ELEMENTS = 1 << 20


def _rows(x: torch.Tensor, filter_wise: bool) -> torch.Tensor:
    if not filter_wise or x.dim() < 2:
        return x.reshape(1, -1)
    return x.reshape(-1, x.shape[-1])


def offset_gram(base: torch.Tensor, models: Sequence[torch.Tensor], filter_wise: bool) -> torch.Tensor:
    """``[rows, N, N]`` float64 dot products of the task vectors, per row (or of the whole tensor)."""
    base_rows = _rows(base, filter_wise)
    model_rows = [_rows(m, filter_wise) for m in models]
    rows, cols = base_rows.shape
    gram = torch.zeros(rows, len(models), len(models), dtype=torch.float64, device=base.device)
    if rows == 1:  # one vector: chunk along it, each chunk's dots in a fixed order (thread-count independent)
        step = ROWS_PER_CHUNK_ELEMENTS
        for start in range(0, cols, step):
            b = base_rows[0, start : start + step].to(torch.float64)
            offsets = [m[0, start : start + step].to(torch.float64) - b for m in model_rows]
            for i, j in _pairs(len(offsets)):
                gram[0, i, j] += stable_dot(offsets[i], offsets[j])
        return _symmetric(gram)
    step = max(1, ROWS_PER_CHUNK_ELEMENTS // max(cols, 1))
    for start in range(0, rows, step):
        b = base_rows[start : start + step].to(torch.float64)
        offsets = [m[start : start + step].to(torch.float64) - b for m in model_rows]
        for i, j in _pairs(len(offsets)):
            gram[start : start + step, i, j] = (offsets[i] * offsets[j]).sum(dim=-1)
    return _symmetric(gram)


def _pairs(count: int) -> list[tuple[int, int]]:
    return [(i, j) for i in range(count) for j in range(i, count)]


def _symmetric(upper: torch.Tensor) -> torch.Tensor:
    return upper + torch.triu(upper, diagonal=1).transpose(1, 2)


def stock_factor(gram: torch.Tensor) -> torch.Tensor:
    """Per row the interpolation factor t (float64 ``[rows]``); 0 where the estimate is singular."""
    count = gram.shape[-1]
    norms = torch.diagonal(gram, dim1=-2, dim2=-1).clamp(min=0).sqrt()
    cosines = []
    for i in range(count):
        for j in range(i + 1, count):
            cosines.append((gram[:, i, j] / (norms[:, i] * norms[:, j]).clamp(min=COSINE_FLOOR)).clamp(-1, 1))
    cos = torch.stack(cosines).mean(dim=0)
    denominator = 1 + (count - 1) * cos
    singular = denominator.abs() < SINGULAR
    return torch.where(singular, torch.zeros_like(cos), count * cos / torch.where(singular, 1.0, denominator))


def model_stock(base: torch.Tensor, models: Sequence[torch.Tensor], filter_wise: bool = False) -> torch.Tensor:
    if len(models) < 2:
        raise ValueError(f"model_stock needs at least two models besides the base, got {len(models)}")
    t = stock_factor(offset_gram(base, models, filter_wise)).to(torch.float32)
    shape = base.shape
    base_rows = _rows(base.to(torch.float32), filter_wise)
    average = _rows(models[0].to(torch.float32), filter_wise).clone()
    for model in models[1:]:
        average.add_(_rows(model, filter_wise).to(torch.float32))
    average.div_(len(models))
    t = t.unsqueeze(-1)
    return average.mul_(t).add_(base_rows * (1 - t)).reshape(shape)


def model_stock_in(
    dtype: torch.dtype, base: torch.Tensor, models: Sequence[torch.Tensor], filter_wise: bool = False
) -> torch.Tensor:
    """Model Stock with every step in a recipe's half ``dtype``, in mergekit's order of operations (whole task
    vectors, their norms and dot products as reductions of that dtype, the mean cosine of a stack, the factor,
    the plain average): what mergekit computes for ``dtype: bfloat16``. Not streamed: the parity path."""
    if len(models) < 2:
        raise ValueError(f"model_stock needs at least two models besides the base, got {len(models)}")
    shape = base.shape
    first, others = base.to(dtype), [m.to(dtype) for m in models]
    if not filter_wise:
        first, others = first.reshape(-1), [m.reshape(-1) for m in others]
    elif first.dim() == 1:
        first, others = first.unsqueeze(0), [m.unsqueeze(0) for m in others]
    offsets = [m - first for m in others]
    cosines = []
    for i, a in enumerate(offsets):
        for b in offsets[i + 1 :]:
            norms = torch.linalg.vector_norm(a, dim=-1) * torch.linalg.vector_norm(b, dim=-1)
            cosines.append(((a * b).sum(dim=-1) / norms.clamp(min=COSINE_FLOOR)).clamp(-1, 1))
    cos = torch.stack(cosines).mean(dim=0).unsqueeze(-1)
    count = len(others)
    denominator = 1 + (count - 1) * cos
    singular = denominator.abs() < SINGULAR
    t = torch.where(singular, torch.zeros_like(cos), (count * cos) / torch.where(singular, 1.0, denominator))
    average = others[0]
    for model in others[1:]:
        average = average + model
    return (t * (average / count) + (1 - t) * first).reshape(shape)


def merge(tensors, base_index, global_params, model_params, generator, owned=False, dtype=torch.float32):
    others = [t for i, t in enumerate(tensors) if i != base_index]
    if dtype != torch.float32:
        return model_stock_in(dtype, tensors[base_index], others, bool(global_params["filter_wise"]))
    return model_stock(tensors[base_index], others, bool(global_params["filter_wise"]))
