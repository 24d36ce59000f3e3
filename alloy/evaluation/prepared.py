"""A dataset split made ready for scoring: read, checked against its task, tokenised once, head loaded.

The same prepared object scores a model loaded from disk (EvaluationService) and a candidate state dict loaded
into a skeleton (CandidateEvaluator), so both paths give the same number by construction.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import pyarrow as pa
import torch

from alloy.errors import validation_failed
from alloy.evaluation.batching import length_sorted_batches, pad_batch, pad_id_of, tokenize_texts
from alloy.evaluation.loglik import ChoiceItem, choice_predictions, truncate_prompt
from alloy.evaluation.perplexity import perplexity
from alloy.evaluation.prototypes import encode, prototype_logits
from alloy.evaluation.tasks import ClassificationTask, MultipleChoiceTask, PerplexityTask, parse_task


@dataclass(frozen=True)
class Score:
    metric: str
    value: float
    n: int  # examples scored (tokens for perplexity)


def _column(table: pa.Table, name: str, dataset_id: str) -> list:
    if name not in table.column_names:
        raise validation_failed(
            f"dataset {dataset_id!r} has no column {name!r}", dataset_id=dataset_id, columns=table.column_names
        )
    return table.column(name).to_pylist()


def _subset(values: Sequence, indices: Sequence[int] | None) -> list:
    return list(values) if indices is None else [values[i] for i in indices]


class PreparedDataset(ABC):
    kind: str  # "encoder" or "causal_lm": the model kind this dataset can score
    metric: str

    def __init__(self, dataset_id: str, split: str):
        self.dataset_id = dataset_id
        self.split = split

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def score(self, model, indices: Sequence[int] | None = None, batch_size: int = 32) -> Score: ...


class PreparedPerplexity(PreparedDataset):
    kind = "causal_lm"
    metric = "perplexity"

    def __init__(self, dataset_id, split, table, task: PerplexityTask, tokenizer):
        super().__init__(dataset_id, split)
        texts = _column(table, task.text_field, dataset_id)
        self.sequences = tokenize_texts(tokenizer, texts, task.max_length)
        self.pad_id = pad_id_of(tokenizer)

    def __len__(self) -> int:
        return len(self.sequences)

    def score(self, model, indices=None, batch_size=8) -> Score:
        value, tokens = perplexity(model, _subset(self.sequences, indices), self.pad_id, batch_size)
        return Score(self.metric, value, tokens)


class PreparedPrototypeClassification(PreparedDataset):
    kind = "encoder"
    metric = "accuracy"

    def __init__(self, dataset_id, split, table, task: ClassificationTask, tokenizer, head: torch.Tensor):
        super().__init__(dataset_id, split)
        if head.ndim != 2 or head.shape[0] != len(task.labels):
            raise validation_failed(
                f"dataset {dataset_id!r}: the head has shape {list(head.shape)}, expected [{len(task.labels)}, hidden]",
                dataset_id=dataset_id,
            )
        self.sequences = tokenize_texts(tokenizer, _column(table, task.text_field, dataset_id), task.max_length)
        self.labels = torch.tensor(_column(table, task.label_field, dataset_id), dtype=torch.long)
        self.prototypes = head.float()
        self.scale = task.scale
        self.pad_id = pad_id_of(tokenizer)

    def __len__(self) -> int:
        return len(self.sequences)

    def predict(self, model, indices=None, batch_size=32) -> torch.Tensor:
        chosen = list(range(len(self.sequences))) if indices is None else list(indices)
        predictions = torch.empty(len(chosen), dtype=torch.long)
        for batch in length_sorted_batches([len(self.sequences[i]) for i in chosen], batch_size):
            input_ids, attention_mask = pad_batch([self.sequences[chosen[i]] for i in batch], self.pad_id)
            with torch.inference_mode():
                embeddings = encode(model, input_ids, attention_mask).float()
            predictions[batch] = prototype_logits(embeddings, self.prototypes, self.scale).argmax(dim=-1)
        return predictions

    def score(self, model, indices=None, batch_size=32) -> Score:
        chosen = list(range(len(self.sequences))) if indices is None else list(indices)
        predictions = self.predict(model, chosen, batch_size)
        labels = self.labels[chosen]
        return Score(
            self.metric, float((predictions == labels).float().mean()) if chosen else float("nan"), len(chosen)
        )


class PreparedChoices(PreparedDataset):
    """Log-likelihood classification and multiple choice for causal LMs."""

    kind = "causal_lm"
    metric = "accuracy"

    def __init__(self, dataset_id, split, table, task: ClassificationTask | MultipleChoiceTask, tokenizer):
        super().__init__(dataset_id, split)
        self.pad_id = pad_id_of(tokenizer)
        self.normalize = getattr(task, "normalize", "sum")
        labels = _column(table, task.label_field, dataset_id)
        if isinstance(task, ClassificationTask):
            prompts = [task.prompt_template.format(text=t) for t in _column(table, task.text_field, dataset_id)]
            shared = [task.choice_template.format(choice=c) for c in task.choices]
            choices = [shared] * len(prompts)
        else:
            prompts = _column(table, task.prompt_field, dataset_id)
            choices = [
                [task.choice_template.format(choice=c) for c in row]
                for row in _column(table, task.choices_field, dataset_id)
            ]
        prompt_ids = tokenize_texts(tokenizer, prompts, 10**6)
        self.items = []
        for prompt, row_choices, label in zip(prompt_ids, choices, labels):
            choice_ids = [
                ids or [self.pad_id]
                for ids in tokenize_texts(tokenizer, row_choices, task.max_length, special_tokens=False)
            ]
            if not 0 <= int(label) < len(choice_ids):
                raise validation_failed(f"dataset {dataset_id!r}: label {label} out of range", dataset_id=dataset_id)
            prompt = truncate_prompt(prompt, max(len(c) for c in choice_ids), task.max_length)
            self.items.append(ChoiceItem(prompt, choice_ids, int(label)))

    def __len__(self) -> int:
        return len(self.items)

    def score(self, model, indices=None, batch_size=16) -> Score:
        items = _subset(self.items, indices)
        if not items:
            return Score(self.metric, float("nan"), 0)
        predictions = choice_predictions(model, items, self.pad_id, batch_size, self.normalize)
        correct = sum(int(p == item.label) for p, item in zip(predictions, items))
        return Score(self.metric, correct / len(items), len(items))


def prepare_dataset(
    dataset_id: str, split: str, table: pa.Table, task_dict: dict, tokenizer, *, head: torch.Tensor | None = None
) -> PreparedDataset:
    task = parse_task(task_dict, dataset_id)
    if isinstance(task, PerplexityTask):
        return PreparedPerplexity(dataset_id, split, table, task, tokenizer)
    if isinstance(task, ClassificationTask) and task.head == "prototypes":
        if head is None:
            raise validation_failed(f"dataset {dataset_id!r}: prototype head not loaded", dataset_id=dataset_id)
        return PreparedPrototypeClassification(dataset_id, split, table, task, tokenizer, head)
    return PreparedChoices(dataset_id, split, table, task, tokenizer)
