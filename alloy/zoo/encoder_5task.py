"""Preset ``encoder-5task``: all-MiniLM-L6-v2 fine-tuned separately on five text classification tasks.

Heads are fixed zero-shot prototypes (the base encoder's embedding of each class's label text), so only the
encoder changes and every fine-tune is a plain BertModel folder that Alloy can merge.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from alloy.evaluation.prototypes import DEFAULT_SCALE, build_prototypes
from alloy.zoo.encoder_finetune import FineTuneRecipe, finetune_encoder
from alloy.zoo.manifest import DatasetEntry, ModelEntry, PresetManifest, write_split
from alloy.zoo.sources import fortunes_dir, pretrained_encoder_dir, wordnet_dir
from alloy.zoo.text_tasks import TextTask, build_text_tasks

log = logging.getLogger(__name__)

PRESET = "encoder-5task"
ID_PREFIX = "enc5"
HEAD_FILE = "head.safetensors"


def check_sources() -> None:
    pretrained_encoder_dir()
    wordnet_dir()
    fortunes_dir()


def task_id(task_name: str) -> str:
    return task_name.replace("_", "-")


def prototype_task_dict(task: TextTask, scale: float = DEFAULT_SCALE) -> dict:
    """The dataset's ``task`` record for prototype classification (schema: docs/API.md, "Evaluation")."""
    return {
        "type": "classification",
        "model_kind": "encoder",
        "text_field": "text",
        "label_field": "label",
        "labels": task.labels,
        "label_texts": task.label_texts,
        "head": "prototypes",
        "head_file": HEAD_FILE,
        "scale": scale,
        "max_length": task.max_length,
    }


def write_classification_dataset(
    folder: Path, task: TextTask, prototypes: torch.Tensor, dataset_id: str
) -> DatasetEntry:
    folder.mkdir(parents=True)
    for split, examples in task.splits.items():
        write_split(folder / f"{split}.parquet", {"text": [t for t, _ in examples], "label": [y for _, y in examples]})
    save_file({"prototypes": prototypes.contiguous()}, str(folder / HEAD_FILE))
    return DatasetEntry(
        dataset_id=dataset_id,
        path=folder,
        splits=list(task.splits),
        task=prototype_task_dict(task),
        description=task.description,
    )


def load_encoder(folder: Path):
    # lazy: transformers costs seconds to import; only model loading needs it
    from transformers import AutoTokenizer, BertModel

    model = BertModel.from_pretrained(str(folder), add_pooling_layer=False, dtype=torch.float32)
    model.eval()
    return model, AutoTokenizer.from_pretrained(str(folder))


def build(
    staging: Path, *, seed: int = 0, recipe: FineTuneRecipe | None = None, tasks: list[str] | None = None
) -> PresetManifest:
    check_sources()
    recipe = recipe or FineTuneRecipe(seed=seed)
    text_tasks = build_text_tasks(wordnet_dir(), fortunes_dir(), seed=seed)
    if tasks:
        text_tasks = {name: text_tasks[name] for name in tasks}

    base_model, tokenizer = load_encoder(pretrained_encoder_dir())
    base_dir = staging / "models" / "base"
    base_model.save_pretrained(str(base_dir), safe_serialization=True)
    tokenizer.save_pretrained(str(base_dir))
    base_id = f"{ID_PREFIX}-base"
    models = [ModelEntry(model_id=base_id, path=base_dir, role="base", description="all-MiniLM-L6-v2 (pretrained)")]
    datasets = []
    timings = {}
    for name, task in text_tasks.items():
        prototypes = build_prototypes(base_model, tokenizer, task.label_texts)
        datasets.append(
            write_classification_dataset(staging / "datasets" / name, task, prototypes, f"{ID_PREFIX}-{task_id(name)}")
        )

        started = time.perf_counter()
        model, _ = load_encoder(base_dir)
        texts, labels = zip(*task.splits["train"])
        losses = finetune_encoder(model, tokenizer, texts, labels, prototypes, task.max_length, recipe)
        out_dir = staging / "models" / f"ft-{name}"
        model.save_pretrained(str(out_dir), safe_serialization=True)
        tokenizer.save_pretrained(str(out_dir))
        timings[name] = round(time.perf_counter() - started, 1)
        log.info("fine-tuned %s in %.1fs (loss %.3f -> %.3f)", name, timings[name], losses[0], losses[-1])
        models.append(
            ModelEntry(
                model_id=f"{ID_PREFIX}-ft-{task_id(name)}",
                path=out_dir,
                role="finetune",
                task=f"{ID_PREFIX}-{task_id(name)}",
                base_model_id=base_id,
                description=f"all-MiniLM-L6-v2 fine-tuned on {name}",
            )
        )
    return PresetManifest(
        preset=PRESET,
        seed=seed,
        root=staging,
        models=models,
        datasets=datasets,
        build_seconds=0.0,
        details={"recipe": recipe.model_dump(), "finetune_seconds": timings},
    )
