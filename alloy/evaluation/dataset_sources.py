"""Where evaluation datasets come from: the DatasetRegistry (service) or a built zoo preset's folders (local).

Either way a source answers ``load(dataset_id, split) -> DatasetSplit``: the table, the task dict and, for
prototype classification, the head tensor.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from safetensors.torch import load as load_safetensors_bytes
from safetensors.torch import load_file

from alloy.errors import not_found, validation_failed

HEAD_TENSOR = "prototypes"


@dataclass
class DatasetSplit:
    dataset_id: str
    split: str
    table: pa.Table
    task: dict[str, Any]
    head: torch.Tensor | None


class DatasetSource(Protocol):
    def load(self, dataset_id: str, split: str) -> DatasetSplit: ...


def _head_from_tensors(tensors: dict[str, torch.Tensor], where: str) -> torch.Tensor:
    if HEAD_TENSOR not in tensors:
        raise validation_failed(f"head file {where} has no {HEAD_TENSOR!r} tensor", tensors=sorted(tensors))
    return tensors[HEAD_TENSOR].float()


def _local_head(task: dict[str, Any], folder: Path | None) -> torch.Tensor | None:
    if task.get("head_path"):
        return _head_from_tensors(load_file(task["head_path"]), task["head_path"])
    if task.get("head_file") and folder is not None:
        path = (folder / task["head_file"]).resolve()
        if folder.resolve() not in path.parents:
            raise validation_failed("head_file escapes the dataset folder", head_file=task["head_file"])
        return _head_from_tensors(load_file(str(path)), str(path))
    return None


class LocalDatasets:
    """Datasets as folders of ``<split>.parquet`` files with their task dicts (a built zoo preset)."""

    def __init__(self, entries: Iterable[Any]):
        # entries: objects with dataset_id, path, task (alloy.zoo.manifest.DatasetEntry)
        self.entries = {entry.dataset_id: entry for entry in entries}

    def load(self, dataset_id: str, split: str) -> DatasetSplit:
        entry = self.entries.get(dataset_id)
        if entry is None:
            raise not_found("dataset", dataset_id)
        path = Path(entry.path) / f"{split}.parquet"
        if not path.exists():
            raise validation_failed(
                f"dataset {dataset_id!r} has no split {split!r}", dataset_id=dataset_id, split=split
            )
        return DatasetSplit(
            dataset_id, split, pq.read_table(path), dict(entry.task), _local_head(entry.task, Path(entry.path))
        )


class RegistryDatasets:
    """Datasets from the DatasetRegistry; prototype heads from the ArtifactStore (``head_artifact``) or a local path."""

    def __init__(self, registry, store=None):
        self.registry = registry
        self.store = store

    def load(self, dataset_id: str, split: str) -> DatasetSplit:
        record = self.registry.get(dataset_id)
        task = dict(getattr(record, "task", None) or {})
        table = self.registry.read_split(dataset_id, split)
        head = None
        if task.get("head_artifact"):
            if self.store is None:
                raise validation_failed("this dataset's head is an artifact but no artifact store is configured")
            with self.store.open(task["head_artifact"]) as handle:
                head = _head_from_tensors(load_safetensors_bytes(handle.read()), task["head_artifact"])
        else:
            head = _local_head(task, None)
        return DatasetSplit(dataset_id, split, table, task, head)
