"""Fast scoring of in-memory candidate weights (evolution): build once, then load and score many times.

Construction loads the dataset splits, tokenises them, loads the heads and keeps one model skeleton. ``score``
loads a candidate state dict into the skeleton (strict, no disk writes) and runs the prepared datasets.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from alloy.errors import validation_failed
from alloy.evaluation.dataset_sources import DatasetSource
from alloy.evaluation.loading import LoadedModel, fit_layer_stack, load_model, load_weights, tied_parameter_names
from alloy.evaluation.prepared import PreparedDataset, prepare_dataset
from alloy.evaluation.tasks import higher_is_better

Indices = Sequence[int] | Mapping[str, Sequence[int] | None] | None  # a dataset mapped to None: all of it


def prepare_for_model(
    loaded: LoadedModel, source: DatasetSource, dataset_ids: Sequence[str], split: str
) -> list[PreparedDataset]:
    prepared = []
    for dataset_id in dataset_ids:
        data = source.load(dataset_id, split)
        dataset = prepare_dataset(dataset_id, split, data.table, data.task, loaded.tokenizer, head=data.head)
        if dataset.kind != loaded.kind:
            raise validation_failed(
                f"dataset {dataset_id!r} scores {dataset.kind} models but the model is a {loaded.kind}",
                dataset_id=dataset_id,
                model_kind=loaded.kind,
            )
        prepared.append(dataset)
    return prepared


def summarize(scores: Mapping[str, tuple[str, float]]) -> dict[str, float]:
    """Per-dataset values plus the mean of each metric (``mean_accuracy``, ``mean_perplexity``)."""
    out = {dataset_id: value for dataset_id, (_, value) in scores.items()}
    by_metric: dict[str, list[float]] = {}
    for metric, value in scores.values():
        by_metric.setdefault(metric, []).append(value)
    for metric, values in by_metric.items():
        out[f"mean_{metric}"] = sum(values) / len(values)
    return out


class CandidateEvaluator:
    """``CandidateEvaluator(model_dir, source, dataset_ids, split="dev")`` then ``score(state_dict)``.

    ``max_examples`` keeps a seeded random subset of each split (for quick evolution fitness)."""

    def __init__(
        self,
        model_dir: str | Path,
        source: DatasetSource,
        dataset_ids: Sequence[str],
        split: str = "dev",
        *,
        batch_size: int = 32,
        max_examples: int | None = None,
        seed: int = 0,
    ):
        self.loaded = load_model(model_dir)
        self.split = split
        self.batch_size = batch_size
        self.datasets = prepare_for_model(self.loaded, source, dataset_ids, split)
        self.tied = tied_parameter_names(self.loaded.model)
        self.subsets: dict[str, list[int] | None] = {}
        rng = random.Random(seed)
        for dataset in self.datasets:
            if max_examples is not None and len(dataset) > max_examples:
                self.subsets[dataset.dataset_id] = sorted(rng.sample(range(len(dataset)), max_examples))
            else:
                self.subsets[dataset.dataset_id] = None

    @property
    def dataset_ids(self) -> list[str]:
        return [d.dataset_id for d in self.datasets]

    def metric_directions(self) -> dict[str, bool]:
        """dataset id -> True when higher is better."""
        return {d.dataset_id: higher_is_better(d.metric) for d in self.datasets}

    def _indices(self, dataset: PreparedDataset, batch_indices: Indices) -> list[int] | None:
        if batch_indices is None:
            return self.subsets[dataset.dataset_id]
        if isinstance(batch_indices, Mapping):
            chosen = batch_indices.get(dataset.dataset_id)
            return None if chosen is None else list(chosen)
        return [i for i in batch_indices if i < len(dataset)]

    def score_loaded(self, batch_indices: Indices = None) -> dict[str, float]:
        """Score whatever weights the skeleton holds now."""
        scores = {}
        for dataset in self.datasets:
            result = dataset.score(self.loaded.model, self._indices(dataset, batch_indices), self.batch_size)
            scores[dataset.dataset_id] = (result.metric, result.value)
        return summarize(scores)

    def score(self, state_dict: Mapping[str, torch.Tensor], batch_indices: Indices = None) -> dict[str, float]:
        """Load ``state_dict`` into the skeleton and score it: ``{dataset_id: value, "mean_<metric>": ...}``."""
        with torch.no_grad():
            fit_layer_stack(self.loaded.model, state_dict)  # a franken candidate may have another depth
            load_weights(self.loaded.model, dict(state_dict), self.tied)
        return self.score_loaded(batch_indices)
