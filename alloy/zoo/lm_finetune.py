"""Language-model fine-tuning of a causal LM on plain texts (next-token loss), optionally only some parameters."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from alloy.evaluation.batching import length_grouped_batches, pad_batch, pad_id_of, tokenize_texts


def finetune_causal_lm(
    model,
    tokenizer,
    texts: Sequence[str],
    *,
    max_length: int,
    steps: int,
    learning_rate: float,
    batch_size: int = 8,
    seed: int = 0,
    trainable: Callable[[str], bool] | None = None,
    clip_norm: float = 1.0,
) -> list[float]:
    """Train in place with AdamW and linear decay; ``trainable(name)`` picks the parameters that move."""
    torch.manual_seed(seed)
    rng = random.Random(seed)
    sequences = [s for s in tokenize_texts(tokenizer, texts, max_length) if len(s) >= 2]
    lengths = [len(s) for s in sequences]
    pad_id = pad_id_of(tokenizer)
    params = [p for name, p in model.named_parameters() if trainable is None or trainable(name)]
    frozen = [p for p in model.parameters() if all(p is not q for q in params)]
    for p in frozen:
        p.requires_grad_(False)
    optimizer = torch.optim.AdamW(params, lr=learning_rate, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: max(0.0, 1 - step / steps))
    model.train()
    losses: list[float] = []
    batches: list[list[int]] = []
    for _ in range(steps):
        if not batches:
            batches = length_grouped_batches(lengths, min(batch_size, len(sequences)), rng)
        input_ids, attention_mask = pad_batch([sequences[i] for i in batches.pop()], pad_id)
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
        targets = input_ids[:, 1:].masked_fill(attention_mask[:, 1:] == 0, -100)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-100)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, clip_norm)
        optimizer.step()
        scheduler.step()
        losses.append(float(loss.detach()))
    for p in frozen:
        p.requires_grad_(True)
    model.eval()
    return losses
