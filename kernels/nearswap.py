"""NearSwap (mergekit's nearswap): take the other model's value where it is close to the base's.

Per entry the weight of the other model is ``clamp(t / max(|base - other|, 1e-6), 0, 1)``: entries that differ by
at most ``t`` are swapped for the other model's, larger differences move proportionally less.
"""

from __future__ import annotations

import torch

DIFF_FLOOR = 1e-6


def nearswap(base: torch.Tensor, other: torch.Tensor, t: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Computed in ``dtype`` (float32, or a recipe's half dtype, every step in it as mergekit computes it)."""
    a, b = base.to(dtype), other.to(dtype)
    weight = t / torch.sub(a, b).abs_().clamp_(min=DIFF_FLOOR)
    weight.clamp_(min=0, max=1)
    out = weight * b
    return out.add_(torch.rsub(weight, 1).mul_(a))  # w * b + (1 - w) * a, mergekit's association


def merge(tensors, base_index, global_params, model_params, generator, owned=False, dtype=torch.float32):
    return nearswap(tensors[base_index], tensors[1 - base_index], float(global_params["t"]), dtype)
