"""The benchmark zoo's presets: build one (cached under ``<data_dir>/zoo/<preset>``) and register it.

``tiny`` builds in seconds from random tiny models (CI, demo); ``encoder-5task`` and ``causal-lm`` build from
real pretrained models and real text installed from PyPI/Debian (see :mod:`alloy.zoo.sources`).
"""

from __future__ import annotations

import importlib
import logging
import os
from pathlib import Path
from typing import Any

from alloy.errors import AlloyError, ErrorCode, validation_failed
from alloy.zoo.manifest import PresetManifest, build_atomically, built_preset

log = logging.getLogger(__name__)

# preset name -> (module with build(staging, seed=...) and check_sources(), one-line description)
PRESETS: dict[str, tuple[str, str]] = {
    "tiny": ("alloy.zoo.tiny_preset", "random tiny BERT encoder + 2 fine-tunes, tiny llama + 2 fine-tunes; seconds"),
    "encoder-5task": ("alloy.zoo.encoder_5task", "all-MiniLM-L6-v2 fine-tuned on 5 WordNet/fortune tasks; ~10-15 min"),
    "causal-lm": (
        "alloy.zoo.causal_lm",
        "SmolLM2-135M as safetensors, full-depth domain fine-tunes, per-domain perplexity sets; ~7 min",
    ),
}


def quiet_build_output() -> None:
    """Silence transformers' per-model progress bars and load reports: a build prints its own summary."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import transformers  # lazy: after the environment above, and only builds pay its seconds of import time

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()


def preset_root(name: str, data_dir: str | Path) -> Path:
    return Path(data_dir) / "zoo" / name


def _module(name: str):
    if name not in PRESETS:
        raise validation_failed(f"unknown preset {name!r}; known: {', '.join(PRESETS)}", preset=name)
    return importlib.import_module(PRESETS[name][0])


def build_preset(name: str, data_dir: str | Path, *, seed: int = 0, force: bool = False) -> PresetManifest:
    """Build (or reuse) preset ``name`` under ``data_dir``; missing sources raise with the install command."""
    module = _module(name)
    root = preset_root(name, data_dir)
    if not force and (existing := built_preset(root)) is not None:
        return existing
    module.check_sources()
    return build_atomically(root, lambda staging: module.build(staging, seed=seed), force=force)


def load_preset(name: str, data_dir: str | Path) -> PresetManifest:
    _module(name)
    manifest = built_preset(preset_root(name, data_dir))
    if manifest is None:
        raise AlloyError(
            ErrorCode.NOT_FOUND, f"preset {name!r} is not built; run: alloy zoo build {name}", {"preset": name}
        )
    return manifest


def register_preset(
    manifest: PresetManifest, models_registry, datasets_registry, *, store=None
) -> dict[str, list[str]]:
    """Register every model and dataset of a built preset; ids already registered are left as they are.

    With an ArtifactStore, prototype heads are uploaded and referenced by ``head_artifact``; without one the
    task records the head's absolute local path (``head_path``)."""
    registered: dict[str, list[str]] = {"models": [], "datasets": []}
    for entry in manifest.models:
        if models_registry.exists(entry.model_id):
            continue
        lineage = (
            {"base_model": entry.base_model_id, "task": entry.task, "preset": manifest.preset}
            if entry.base_model_id
            else None
        )
        models_registry.register(entry.model_id, str(entry.path), lineage=lineage)
        registered["models"].append(entry.model_id)
    for dataset in manifest.datasets:
        if _dataset_exists(datasets_registry, dataset.dataset_id):
            continue
        datasets_registry.register(
            dataset.dataset_id,
            {split: str(dataset.split_path(split)) for split in dataset.splits},
            task=_registered_task(manifest, dataset, store),
            description=dataset.description,
        )
        registered["datasets"].append(dataset.dataset_id)
    return registered


def _dataset_exists(datasets_registry, dataset_id: str) -> bool:
    exists = getattr(datasets_registry, "exists", None)
    if exists is not None:
        return bool(exists(dataset_id))
    try:
        datasets_registry.get(dataset_id)
        return True
    except AlloyError as exc:
        if exc.code in (ErrorCode.NOT_FOUND, ErrorCode.MODEL_NOT_FOUND):
            return False
        raise


def _registered_task(manifest: PresetManifest, entry, store) -> dict[str, Any]:
    task = dict(entry.task)
    head_file = task.pop("head_file", None)
    if head_file is not None:
        local = entry.path / head_file
        if store is not None:
            key = f"zoo/{manifest.preset}/{entry.dataset_id}/{head_file}"
            store.put_file(key, local)
            task["head_artifact"] = key
        else:
            task["head_path"] = str(local.resolve())
    return task
