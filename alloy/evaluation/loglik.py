"""Multiple choice and classification for causal LMs by log-likelihood: the prediction is the choice whose
continuation tokens are most likely after the prompt."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from alloy.evaluation.batching import length_sorted_batches, pad_batch


@dataclass(frozen=True)
class ChoiceItem:
    prompt_ids: list[int]
    choice_ids: list[list[int]]  # continuation tokens of each choice (non-empty)
    label: int


def continuation_logprobs(
    model, prompts: Sequence[list[int]], continuations: Sequence[list[int]], pad_id: int, batch_size: int
) -> list[tuple[float, int]]:
    """For each (prompt, continuation) pair: summed log-probability of the continuation tokens and their count."""
    sequences = [p + c for p, c in zip(prompts, continuations)]
    out: list[tuple[float, int]] = [(0.0, 0)] * len(sequences)
    for batch in length_sorted_batches([len(s) for s in sequences], batch_size):
        input_ids, attention_mask = pad_batch([sequences[i] for i in batch], pad_id)
        with torch.inference_mode():
            logprobs = torch.log_softmax(
                model(input_ids=input_ids, attention_mask=attention_mask).logits.float(), dim=-1
            )
        for row, index in enumerate(batch):
            start, end = len(prompts[index]), len(sequences[index])
            targets = input_ids[row, start:end]
            # token t is predicted by the logits at position t-1
            picked = logprobs[row, start - 1 : end - 1].gather(-1, targets.unsqueeze(-1))
            out[index] = (float(picked.sum()), end - start)
    return out


def truncate_prompt(prompt: list[int], longest_choice: int, max_length: int) -> list[int]:
    """Keep the end of the prompt (it holds the question) so that prompt + choice fits ``max_length``."""
    room = max(1, max_length - longest_choice)
    return prompt[-room:]


def choice_predictions(
    model, items: Sequence[ChoiceItem], pad_id: int, batch_size: int, normalize: str = "sum"
) -> list[int]:
    prompts: list[list[int]] = []
    continuations: list[list[int]] = []
    owners: list[int] = []
    for index, item in enumerate(items):
        for choice_ids in item.choice_ids:
            prompts.append(item.prompt_ids)
            continuations.append(choice_ids)
            owners.append(index)
    scores = continuation_logprobs(model, prompts, continuations, pad_id, batch_size)
    best: list[tuple[float, int]] = [(-float("inf"), -1)] * len(items)
    counters = [0] * len(items)
    for (logprob, count), owner in zip(scores, owners):
        value = logprob / count if normalize == "mean" else logprob
        choice = counters[owner]
        counters[owner] += 1
        if value > best[owner][0]:
            best[owner] = (value, choice)
    return [choice for _, choice in best]
