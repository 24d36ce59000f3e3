"""What a built preset contains, and the staged, atomic way it is written.

A preset lives in ``<data_dir>/zoo/<preset>/`` with ``manifest.json`` at its root. It is built in a staging
folder beside it and renamed into place only when complete, so a crash never leaves a half-built preset that
looks finished; a leftover staging folder is simply removed by the next build.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import BaseModel, Field

MANIFEST_FILE = "manifest.json"


class ModelEntry(BaseModel):
    model_id: str
    path: Path
    role: Literal["base", "finetune"]
    task: str | None = None  # the task a fine-tune was trained on
    base_model_id: str | None = None
    description: str = ""


class DatasetEntry(BaseModel):
    dataset_id: str
    path: Path  # folder holding <split>.parquet files (and a head file for prototype tasks)
    splits: list[str]
    task: dict[str, Any]
    description: str = ""

    def split_path(self, split: str) -> Path:
        return self.path / f"{split}.parquet"


class PresetManifest(BaseModel):
    preset: str
    seed: int
    root: Path
    models: list[ModelEntry]
    datasets: list[DatasetEntry]
    build_seconds: float
    details: dict[str, Any] = Field(default_factory=dict)

    def model(self, model_id: str) -> ModelEntry:
        return next(m for m in self.models if m.model_id == model_id)

    def dataset(self, dataset_id: str) -> DatasetEntry:
        return next(d for d in self.datasets if d.dataset_id == dataset_id)

    @property
    def base(self) -> ModelEntry:
        return next(m for m in self.models if m.role == "base")

    def finetunes(self, base_model_id: str | None = None) -> list[ModelEntry]:
        return [
            m
            for m in self.models
            if m.role == "finetune" and (base_model_id is None or m.base_model_id == base_model_id)
        ]

    def save(self) -> None:
        """Write with paths relative to ``root`` so the folder can move."""
        data = self.model_dump(mode="json")
        data.pop("root")
        for entry in data["models"] + data["datasets"]:
            entry["path"] = os.path.relpath(entry["path"], self.root)
        (self.root / MANIFEST_FILE).write_text(json.dumps(data, indent=2))

    @classmethod
    def load(cls, root: Path) -> PresetManifest:
        data = json.loads((root / MANIFEST_FILE).read_text())
        for entry in data["models"] + data["datasets"]:
            entry["path"] = str((root / entry["path"]).resolve())
        return cls(root=root.resolve(), **data)


def write_split(path: Path, columns: dict[str, Sequence[Any]]) -> None:
    pq.write_table(pa.table({name: list(values) for name, values in columns.items()}), path)


def built_preset(root: Path) -> PresetManifest | None:
    return PresetManifest.load(root) if (root / MANIFEST_FILE).exists() else None


def build_atomically(root: Path, builder: Callable[[Path], PresetManifest], *, force: bool = False) -> PresetManifest:
    """Reuse a finished build at ``root``; otherwise run ``builder(staging)`` and rename staging to ``root``."""
    if not force and (existing := built_preset(root)) is not None:
        return existing
    root.parent.mkdir(parents=True, exist_ok=True)
    for leftover in root.parent.glob(f".staging-{root.name}-*"):
        shutil.rmtree(leftover, ignore_errors=True)
    staging = root.parent / f".staging-{root.name}-{os.getpid()}"
    staging.mkdir()
    started = time.perf_counter()
    try:
        manifest = builder(staging)
        manifest.build_seconds = round(time.perf_counter() - started, 1)
        manifest.root = staging
        manifest.save()
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if root.exists():
        shutil.rmtree(root)
    staging.rename(root)
    return PresetManifest.load(root)
