"""Arcee Fusion (mergekit's arcee_fusion): take the other model's value only where the change is important.

Importance of an entry is ``|other - base|`` times the KL divergence of softmax(other) from softmax(base) along
the last dimension (of its row); entries whose importance reaches ``median + 1.5 * (q3 - q1)`` take the other
model's value, the rest keep the base's. The quartiles are the sorted values at index ``int(q * (n - 1))``.
mergekit estimates them from a random sample of 1,000,000 entries when a tensor is larger than that; here they
are exact for every size, so this kernel is deterministic (and matches mergekit exactly up to 1,000,000 entries).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

KL_EPS = 1e-8
QUARTILES = (0.25, 0.5, 0.75)


def importance(other: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    p = F.softmax(other, dim=-1).add_(KL_EPS)
    q = F.softmax(base, dim=-1).add_(KL_EPS)
    kl = torch.sum(p * torch.log(p / q), dim=-1, keepdim=True)
    del p, q
    return torch.sub(other, base).abs_().mul_(kl)


def quartiles(values: torch.Tensor) -> list[float]:
    flat = values.reshape(-1).cpu()
    # The float32 product, truncated, is how mergekit picks the index.
    indices = (torch.tensor(QUARTILES, dtype=torch.float32) * (flat.numel() - 1)).long().tolist()
    return [float(torch.kthvalue(flat, index + 1).values) for index in indices]


def arcee_fusion(base: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    base, other = base.to(torch.float32), other.to(torch.float32)
    scores = importance(other, base)
    q1, median, q3 = (torch.tensor(v, dtype=torch.float32) for v in quartiles(scores))
    threshold = median + 1.5 * (q3 - q1)
    keep = scores >= threshold.to(scores.device)
    del scores
    return torch.sub(other, base).mul_(keep).add_(base)


def merge(tensors, base_index, global_params, model_params, generator, owned=False):
    return arcee_fusion(tensors[base_index], tensors[1 - base_index])
