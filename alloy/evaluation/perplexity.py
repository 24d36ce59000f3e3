"""Perplexity of a causal LM: exp of the token-weighted mean negative log-likelihood over a corpus."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from alloy.evaluation.batching import length_sorted_batches, pad_batch


def sequence_nll(logits: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[float, int]:
    """Summed NLL of every token predicted from a real previous token, and how many such tokens there are."""
    predicted = logits[:, :-1].float()
    targets = input_ids[:, 1:]
    valid = attention_mask[:, 1:].bool()
    nll = F.cross_entropy(predicted.reshape(-1, predicted.size(-1)), targets.reshape(-1), reduction="none")
    nll = nll.view_as(targets)[valid]
    return float(nll.sum()), int(valid.sum())


def corpus_nll(model, sequences: Sequence[Sequence[int]], pad_id: int, batch_size: int) -> tuple[float, int]:
    total, count = 0.0, 0
    usable = [s for s in sequences if len(s) >= 2]
    for batch in length_sorted_batches([len(s) for s in usable], batch_size):
        input_ids, attention_mask = pad_batch([usable[i] for i in batch], pad_id)
        with torch.inference_mode():
            logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
        nll, n = sequence_nll(logits, input_ids, attention_mask)
        total += nll
        count += n
    return total, count


def perplexity(model, sequences: Sequence[Sequence[int]], pad_id: int, batch_size: int = 8) -> tuple[float, int]:
    """(perplexity, number of predicted tokens)."""
    total, count = corpus_nll(model, sequences, pad_id, batch_size)
    if count == 0:
        return float("nan"), 0
    return math.exp(total / count), count
