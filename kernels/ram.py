"""Reinforced Agent Merging (mergekit's ram and ramplus_tl): entries changed by only one model keep that model's
change, entries changed by several get the mean of their changes. A change counts when ``|x_i - base| > epsilon``.

ramplus_tl also scales each model's unique changes by ``1 + r * clamp(rho, 0, alpha)``, with rho the model's
count of shared changes over its count of unique ones (in this tensor). That scale is float32 (counts divided),
so in a half dtype the scaled changes, the sum and the result are float32, as mergekit's are.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kernels.task_arithmetic import task_vector


def _changed(model: torch.Tensor, base: torch.Tensor, epsilon: float, dtype: torch.dtype) -> torch.Tensor:
    return torch.sub(model.to(dtype), base.to(dtype)).abs_() > epsilon


def _change_counts(base, models, epsilon, dtype) -> torch.Tensor:
    """Per entry, how many models change it (a small integer type: the counts never exceed the model count)."""
    counts = torch.zeros(base.shape, dtype=torch.uint8 if len(models) < 256 else torch.int32, device=base.device)
    for model in models:
        counts.add_(_changed(model, base, epsilon, dtype))
    return counts


def ram(
    base: torch.Tensor,
    models: Sequence[torch.Tensor],
    epsilon: float = 1e-5,
    *,
    r: float | None = None,
    alpha: float = 0.0,
    owned: bool = False,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``r = None`` is plain RAM; otherwise RAM+ (tensor-local). Two passes over the models (count the changes,
    then combine them), so no task vector is kept longer than one model's turn. Computed in ``dtype`` (float32, or
    a recipe's half dtype as mergekit computes RAM: the changes, their means and the sum in it; mergekit sums the
    models' terms in one reduction, rounding once, where this rounds at each model after the second). RAM+ sums
    in float32 whatever ``dtype`` (its scale is float32) and returns float32."""
    if not models:
        return base.to(dtype).clone()
    counts = _change_counts(base, models, epsilon, dtype)
    unique = counts == 1
    overlap = counts > 1
    divisor = counts.clamp(min=1).to(torch.float32)
    del counts
    total = dtype if r is None else torch.promote_types(dtype, torch.float32)
    out = torch.zeros(base.shape, dtype=total, device=base.device)
    for model in models:
        delta = task_vector(model, base, owned, dtype)
        changed = delta.abs() > epsilon
        delta.mul_(changed)
        # unique and overlap are disjoint, so adding the two parts one after the other gives mergekit's bits
        own = delta * unique
        if r is not None:
            own = own.to(total).mul_(_plus_scale(changed, unique, overlap, epsilon, r, alpha))
        del changed
        out.add_(own)
        del own
        out.add_(delta.div_(divisor).mul_(overlap))
        del delta
    return out.add_(base.to(dtype))


def _plus_scale(changed, unique, overlap, epsilon: float, r: float, alpha: float) -> torch.Tensor:
    """RAM+'s ``1 + r * clamp(shared / max(unique, epsilon), 0, alpha)`` for one model, a float32 scalar tensor
    computed as mergekit computes it (integer counts, the clamp to a float minimum promoting them to float32)."""
    shared_count = (changed & overlap).sum()
    unique_count = (changed & unique).sum()
    rho = shared_count / unique_count.clamp(min=epsilon)
    return 1 + r * rho.clamp(min=0, max=alpha)


def merge_ram(tensors, base_index, global_params, model_params, generator, owned=False, dtype=torch.float32):
    others = [t for i, t in enumerate(tensors) if i != base_index]
    return ram(tensors[base_index], others, float(global_params["epsilon"]), owned=owned, dtype=dtype)


def merge_ramplus_tl(tensors, base_index, global_params, model_params, generator, owned=False, dtype=torch.float32):
    others = [t for i, t in enumerate(tensors) if i != base_index]
    return ram(
        tensors[base_index],
        others,
        float(global_params["epsilon"]),
        r=float(global_params["r"]),
        alpha=float(global_params["alpha"]),
        owned=owned,
        dtype=dtype,
    )
