"""Reinforced Agent Merging (mergekit's ram and ramplus_tl): entries changed by only one model keep that model's
change, entries changed by several get the mean of their changes. A change counts when ``|x_i - base| > epsilon``.

ramplus_tl also scales each model's unique changes by ``1 + r * clamp(rho, 0, alpha)``, with rho the model's
count of shared changes over its count of unique ones (in this tensor).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kernels.task_arithmetic import task_vector


def _changes(base, models, epsilon, owned):
    deltas = [task_vector(m, base, owned) for m in models]
    changed = [d.abs() > epsilon for d in deltas]
    counts = torch.zeros(base.shape, dtype=torch.int64, device=base.device)
    for mask in changed:
        counts.add_(mask)
    return deltas, changed, counts


def ram(base: torch.Tensor, models: Sequence[torch.Tensor], epsilon: float = 1e-5, *, r: float = 0.0,
        alpha: float = 0.0, owned: bool = False) -> torch.Tensor:
    """``r = 0`` is plain RAM; ``r > 0`` is RAM+ (tensor-local)."""
    if not models:
        return base.to(torch.float32).clone()
    deltas, changed, counts = _changes(base, models, epsilon, owned)
    unique = counts == 1
    overlap = counts > 1
    shared_divisor = counts.clamp(min=1).to(torch.float32)
    out = torch.zeros(base.shape, dtype=torch.float32, device=base.device)
    for delta, mask in zip(deltas, changed):
        scale = 1.0
        if r:
            rho = float((mask & overlap).sum()) / max(float((mask & unique).sum()), epsilon)
            scale = 1 + r * min(max(rho, 0.0), alpha)
        delta.mul_(mask)
        term = torch.where(overlap, delta / shared_divisor, delta * unique)
        if scale != 1.0:
            term = torch.where(unique, delta * scale, term)
        out.add_(term)
    return out.add_(base.to(torch.float32))


def merge_ram(tensors, base_index, global_params, model_params, generator, owned=False):
    others = [t for i, t in enumerate(tensors) if i != base_index]
    return ram(tensors[base_index], others, float(global_params["epsilon"]), owned=owned)


def merge_ramplus_tl(tensors, base_index, global_params, model_params, generator, owned=False):
    others = [t for i, t in enumerate(tensors) if i != base_index]
    return ram(tensors[base_index], others, float(global_params["epsilon"]), r=float(global_params["r"]),
               alpha=float(global_params["alpha"]), owned=owned)
