"""Arcee Fusion (mergekit's arcee_fusion): take the other model's value only where the change is important.

Importance of an entry is ``|other - base|`` times the KL divergence of softmax(other) from softmax(base) along
the last dimension (of its row); entries whose importance reaches ``median + 1.5 * (q3 - q1)`` take the other
model's value, the rest keep the base's. The quartiles are the sorted values at index ``int(q * (n - 1))``.
mergekit estimates them from a random sample of 1,000,000 entries when a tensor is larger than that; here they
are exact for every size, so this kernel is deterministic (and matches mergekit exactly up to 1,000,000 entries).

In a half dtype (a mergekit recipe's ``dtype: bfloat16``) the importance, the quartiles and the threshold are
computed in that dtype op for op, as mergekit computes them; the mask is float32 there, so the change times the
mask, plus the base, is float32 (mergekit's result dtype, which it writes unless ``out_dtype`` says otherwise).
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


def threshold(scores: torch.Tensor) -> torch.Tensor:
    """``median + 1.5 * (q3 - q1)`` of the scores, in their dtype. The quartiles are entries of ``scores``, so
    holding them in its dtype is exact; the difference, product and sum then round in it, as mergekit's do."""
    q1, median, q3 = (torch.tensor(v, dtype=scores.dtype) for v in quartiles(scores))
    return median + 1.5 * (q3 - q1)


def arcee_fusion(base: torch.Tensor, other: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The fused tensor, float32 whatever ``dtype`` the importance is computed in."""
    base, other = base.to(dtype), other.to(dtype)
    scores = importance(other, base)
    keep = scores >= threshold(scores).to(scores.device)
    del scores
    # the change rounds in ``dtype``; times the 0/1 mask and plus the base it is float32 (exact but for the sum)
    return torch.sub(other, base).to(torch.float32).mul_(keep).add_(base)


def merge(tensors, base_index, global_params, model_params, generator, owned=False, dtype=torch.float32):
    return arcee_fusion(tensors[base_index], tensors[1 - base_index], dtype)
