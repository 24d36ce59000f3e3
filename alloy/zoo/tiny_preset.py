"""Preset ``tiny``: a seconds-long zoo for CI and the demo, from random tiny models and synthetic text.

* Encoder: a random 2-layer BERT (char tokenizer) and a fine-tune per classification task ("letters", "case"),
  with prototype heads (class means of the base encoder's train embeddings).
* Causal LM: a random 2-layer llama and fine-tunes on two text domains ("words", "sums"), perplexity sets per
  domain, and a log-likelihood classification set.
"""

from __future__ import annotations

import random
import shutil
import string
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from alloy.evaluation.batching import pad_batch, pad_id_of, tokenize_texts
from alloy.evaluation.prototypes import encode
from alloy.zoo.char_tokenizer import char_tokenizer
from alloy.zoo.encoder_finetune import FineTuneRecipe, finetune_encoder
from alloy.zoo.lm_finetune import finetune_causal_lm
from alloy.zoo.manifest import DatasetEntry, ModelEntry, PresetManifest, write_split
from alloy.zoo.tiny_models import build_tiny_model

PRESET = "tiny"
SIZES = {"train": 96, "dev": 16, "test": 32}  # per class
LETTER_GROUPS = ["abcdefgh", "ijklmnop", "qrstuvwx"]
SYLLABLES = ["ba", "ko", "ri", "ne", "tu", "sa", "mi", "lo", "de", "fa", "gu", "pe"]


def check_sources() -> None:
    """Everything is generated; nothing to install."""


def _mixed_text(rng: random.Random, alphabet: str, noise: str, share: float, length: int) -> str:
    chars = [rng.choice(alphabet) if rng.random() < share else rng.choice(noise) for _ in range(length)]
    for position in range(4, length, rng.randint(4, 7)):
        chars[position] = " "
    return "".join(chars).strip()


def _classification_splits(
    rng: random.Random, classes: list[tuple[str, str]], share: float
) -> dict[str, list[tuple[str, int]]]:
    splits: dict[str, list[tuple[str, int]]] = {name: [] for name in SIZES}
    for label, (alphabet, noise) in enumerate(classes):
        for name, count in SIZES.items():
            splits[name] += [
                (_mixed_text(rng, alphabet, noise, share, rng.randint(12, 30)), label) for _ in range(count)
            ]
    for examples in splits.values():
        rng.shuffle(examples)
    return splits


def _encoder_tasks(rng: random.Random) -> dict[str, tuple[list[str], dict]]:
    lower = string.ascii_lowercase
    return {
        "letters": (["a-h", "i-p", "q-x"], _classification_splits(rng, [(g, lower) for g in LETTER_GROUPS], 0.4)),
        "case": (
            ["lower", "upper"],
            _classification_splits(rng, [(lower, string.ascii_uppercase), (string.ascii_uppercase, lower)], 0.6),
        ),
    }


def _words(rng: random.Random) -> str:
    return " ".join("".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 3))) for _ in range(rng.randint(3, 7)))


def _sums(rng: random.Random) -> str:
    a, b = rng.randint(0, 99), rng.randint(0, 99)
    return f"{a}+{b}={a + b}; {b}+{a}={a + b}"


def _class_mean_prototypes(model, tokenizer, texts: list[str], labels: list[int], classes: int) -> torch.Tensor:
    sequences = tokenize_texts(tokenizer, texts, 64)
    input_ids, attention_mask = pad_batch(sequences, pad_id_of(tokenizer))
    with torch.inference_mode():
        embeddings = encode(model, input_ids, attention_mask)
    label_tensor = torch.tensor(labels)
    return F.normalize(torch.stack([embeddings[label_tensor == c].mean(0) for c in range(classes)]), dim=-1)


def _save(model, tokenizer, folder: Path) -> Path:
    model.save_pretrained(str(folder), safe_serialization=True)
    tokenizer.save_pretrained(str(folder))
    return folder


def _build_encoders(staging: Path, seed: int, rng: random.Random) -> tuple[list[ModelEntry], list[DatasetEntry]]:
    # lazy: transformers costs seconds to import; only model loading needs it
    from transformers import BertModel

    tokenizer = char_tokenizer("encoder")
    # Saved without the pooler, like every fine-tune, so base and fine-tunes hold the same tensors.
    random_dir = build_tiny_model(staging / "random-bert", "bert", seed=seed)
    base_dir = _save(
        BertModel.from_pretrained(str(random_dir), add_pooling_layer=False), tokenizer, staging / "models" / "enc-base"
    )
    shutil.rmtree(random_dir)
    models = [ModelEntry(model_id="tiny-enc-base", path=base_dir, role="base", description="random tiny BERT")]
    datasets = []
    for name, (labels, splits) in _encoder_tasks(rng).items():
        base = BertModel.from_pretrained(str(base_dir), add_pooling_layer=False).eval()
        texts, targets = map(list, zip(*splits["train"]))
        prototypes = _class_mean_prototypes(base, tokenizer, texts, targets, len(labels))
        folder = staging / "datasets" / f"enc-{name}"
        folder.mkdir(parents=True)
        for split, examples in splits.items():
            write_split(
                folder / f"{split}.parquet", {"text": [t for t, _ in examples], "label": [y for _, y in examples]}
            )
        save_file({"prototypes": prototypes.contiguous()}, str(folder / "head.safetensors"))
        task = {
            "type": "classification",
            "model_kind": "encoder",
            "text_field": "text",
            "label_field": "label",
            "labels": labels,
            "head": "prototypes",
            "head_file": "head.safetensors",
            "scale": 25.0,
            "max_length": 64,
        }
        datasets.append(
            DatasetEntry(
                dataset_id=f"tiny-{name}",
                path=folder,
                splits=list(splits),
                task=task,
                description=f"synthetic {name} classification",
            )
        )
        finetune_encoder(
            base,
            tokenizer,
            texts,
            targets,
            prototypes,
            64,
            FineTuneRecipe(learning_rate=2e-3, steps=40, seed=seed, freeze_word_embeddings=False),
        )
        models.append(
            ModelEntry(
                model_id=f"tiny-enc-ft-{name}",
                path=_save(base, tokenizer, staging / "models" / f"enc-ft-{name}"),
                role="finetune",
                task=f"tiny-{name}",
                base_model_id="tiny-enc-base",
                description=f"tiny BERT fine-tuned on {name}",
            )
        )
    return models, datasets


def _build_causal_lms(staging: Path, seed: int, rng: random.Random) -> tuple[list[ModelEntry], list[DatasetEntry]]:
    # lazy: transformers costs seconds to import; only model loading needs it
    from transformers import AutoModelForCausalLM

    tokenizer = char_tokenizer("causal_lm")
    base_dir = build_tiny_model(staging / "models" / "lm-base", "llama", seed=seed)
    tokenizer.save_pretrained(str(base_dir))
    models = [ModelEntry(model_id="tiny-lm-base", path=base_dir, role="base", description="random tiny llama")]
    datasets = []
    for name, make in (("words", _words), ("sums", _sums)):
        train = [make(rng) for _ in range(256)]
        folder = staging / "datasets" / f"lm-{name}"
        folder.mkdir(parents=True)
        for split in ("dev", "test"):
            write_split(folder / f"{split}.parquet", {"text": [make(rng) for _ in range(24)]})
        datasets.append(
            DatasetEntry(
                dataset_id=f"tiny-ppl-{name}",
                path=folder,
                splits=["dev", "test"],
                task={"type": "perplexity", "text_field": "text", "max_length": 64},
                description=f"synthetic {name} text (perplexity)",
            )
        )
        model = AutoModelForCausalLM.from_pretrained(str(base_dir)).eval()
        finetune_causal_lm(model, tokenizer, train, max_length=64, steps=40, learning_rate=3e-3, seed=seed)
        models.append(
            ModelEntry(
                model_id=f"tiny-lm-ft-{name}",
                path=_save(model, tokenizer, staging / "models" / f"lm-ft-{name}"),
                role="finetune",
                task=f"tiny-ppl-{name}",
                base_model_id="tiny-lm-base",
                description=f"tiny llama trained on {name} text",
            )
        )
    # Log-likelihood classification: which kind of text is this?
    folder = staging / "datasets" / "lm-kind"
    folder.mkdir(parents=True)
    for split in ("dev", "test"):
        rows = [(_words(rng), 0) for _ in range(12)] + [(_sums(rng), 1) for _ in range(12)]
        rng.shuffle(rows)
        write_split(folder / f"{split}.parquet", {"text": [t for t, _ in rows], "label": [y for _, y in rows]})
    datasets.append(
        DatasetEntry(
            dataset_id="tiny-lm-kind",
            path=folder,
            splits=["dev", "test"],
            description="words or sums (log-likelihood)",
            task={
                "type": "classification",
                "model_kind": "causal_lm",
                "text_field": "text",
                "label_field": "label",
                "labels": ["words", "sums"],
                "label_texts": ["ba", "1"],
                "head": "loglik",
                "prompt_template": "{text} ",
                "choice_template": "{choice}",
                "max_length": 64,
            },
        )
    )
    return models, datasets


def build(staging: Path, *, seed: int = 0) -> PresetManifest:
    torch.manual_seed(seed)
    rng = random.Random(seed)
    encoder_models, encoder_datasets = _build_encoders(staging, seed, rng)
    lm_models, lm_datasets = _build_causal_lms(staging, seed, rng)
    return PresetManifest(
        preset=PRESET,
        seed=seed,
        root=staging,
        models=encoder_models + lm_models,
        datasets=encoder_datasets + lm_datasets,
        build_seconds=0.0,
    )
