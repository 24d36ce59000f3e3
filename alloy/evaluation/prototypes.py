"""Sentence-embedding classification with a fixed head of class prototypes.

An encoder's sentence embedding is the attention-masked mean of its last hidden states, L2-normalised. The
head is one unit vector per class; logits are ``scale × cosine``. Because the head is fixed and stored with the
dataset, every fine-tune of an encoder stays a plain encoder folder and merges of them are scored with the
same head.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

DEFAULT_SCALE = 25.0


def mean_pool(hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Normalised mean of ``hidden`` [B, T, H] over the positions where ``attention_mask`` [B, T] is 1."""
    weights = attention_mask.to(hidden.dtype).unsqueeze(-1)
    summed = (hidden * weights).sum(dim=1)
    counts = weights.sum(dim=1).clamp(min=1.0)
    return F.normalize(summed / counts, dim=-1)


def encode(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    output = model(input_ids=input_ids, attention_mask=attention_mask)
    return mean_pool(output.last_hidden_state, attention_mask)


def prototype_logits(embeddings: torch.Tensor, prototypes: torch.Tensor, scale: float = DEFAULT_SCALE) -> torch.Tensor:
    """``scale × cos(embedding, prototype)`` for every class: [B, C]."""
    return scale * F.normalize(embeddings, dim=-1) @ F.normalize(prototypes, dim=-1).T


def accuracy(predictions: torch.Tensor, labels: torch.Tensor) -> float:
    if labels.numel() == 0:
        return float("nan")
    return float((predictions == labels).float().mean())


def build_prototypes(model, tokenizer, label_texts: list[str], max_length: int = 32) -> torch.Tensor:
    """One prototype per class: the encoder's normalised embedding of the class's label text."""
    encoded = tokenizer(label_texts, truncation=True, max_length=max_length, padding=True, return_tensors="pt")
    with torch.inference_mode():
        return encode(model, encoded["input_ids"], encoded["attention_mask"]).float()
