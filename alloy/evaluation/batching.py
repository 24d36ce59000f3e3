"""Tokenise once, then cut the examples into padded batches.

Batches group examples of similar length (sorted within shuffled mega-batches), which on CPU saves most of
the compute spent on padding without changing any result: each example is scored independently.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch


def tokenize_texts(tokenizer, texts: Sequence[str], max_length: int, *, special_tokens: bool = True) -> list[list[int]]:
    encoded = tokenizer(list(texts), truncation=True, max_length=max_length, add_special_tokens=special_tokens)
    return [list(ids) for ids in encoded["input_ids"]]


def pad_batch(sequences: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ``input_ids`` and ``attention_mask`` (both int64)."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, sequence in enumerate(sequences):
        ids[row, : len(sequence)] = torch.tensor(sequence, dtype=torch.long)
        mask[row, : len(sequence)] = 1
    return ids, mask


def length_sorted_batches(lengths: Sequence[int], batch_size: int) -> list[list[int]]:
    """Deterministic batches for evaluation: indices sorted by length, then chunked."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


def length_grouped_batches(
    lengths: Sequence[int], batch_size: int, rng: random.Random, group: int = 8
) -> list[list[int]]:
    """Random batches for training whose members have similar lengths."""
    order = list(range(len(lengths)))
    rng.shuffle(order)
    span = batch_size * group
    batches = []
    for start in range(0, len(order), span):
        chunk = sorted(order[start : start + span], key=lambda i: lengths[i])
        batches += [
            chunk[i : i + batch_size]
            for i in range(0, len(chunk), batch_size)
            if len(chunk[i : i + batch_size]) == batch_size
        ]
    rng.shuffle(batches)
    return batches


def pad_id_of(tokenizer) -> int:
    if tokenizer.pad_token_id is not None:
        return int(tokenizer.pad_token_id)
    if tokenizer.eos_token_id is not None:
        return int(tokenizer.eos_token_id)
    return 0
