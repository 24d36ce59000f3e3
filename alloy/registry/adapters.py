"""PEFT LoRA adapters in the model registry, and merge inputs written ``base-id+adapter-id``.

An adapter is registered like a model (``POST /models``): a folder with ``adapter_config.json`` and
``adapter_model.safetensors``, recognised by its ``adapter_config.json`` (or registered with ``kind: adapter``).
Its registry entry is a manifest of the adapter's LoRA tensors (``model_type`` :data:`ADAPTER_MODEL_TYPE`, the
adapter config as ``config``); pickled adapters, DoRA, embedding LoRAs and the other forms
:mod:`alloy.merge.lora` refuses are refused at registration.

A merge input ``base-id+adapter-id`` (registry ids never contain ``+``) is the base model with the adapter folded
in: its manifest is the base's, once the adapter is known (MODEL_NOT_FOUND naming the missing id), is an adapter,
and fits the base's shapes (INCOMPATIBLE_MODELS), all checked before a job exists.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from alloy.errors import AlloyError, ErrorCode
from alloy.merge.lora import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    AdapterConfig,
    LoraSource,
    adapter_pairs,
    check_adapter_fits,
    read_adapter_config,
    split_reference,
    weights_file,
)
from alloy.model_manifest import DTYPE_BYTES, ModelManifest, TensorInfo, read_manifest, read_safetensors_header

ADAPTER_MODEL_TYPE = "peft-lora-adapter"
Kind = Literal["model", "adapter"]


def is_adapter(manifest: ModelManifest) -> bool:
    return manifest.model_type == ADAPTER_MODEL_TYPE


def detect_kind(folder: Path) -> Kind:
    """A folder with ``adapter_config.json`` and no ``config.json`` is a PEFT adapter (as PEFT tells them apart)."""
    return "adapter" if (folder / CONFIG_FILE).is_file() and not (folder / "config.json").is_file() else "model"


def read_entry_manifest(folder: Path, model_id: str, kind: Kind | None = None) -> ModelManifest:
    """The manifest the registry stores for a model or adapter folder (``kind`` None: detected)."""
    if (kind or detect_kind(folder)) == "adapter":
        return read_adapter_manifest(folder, model_id)
    return read_manifest(folder)


def read_adapter_manifest(folder: Path, adapter_id: str) -> ModelManifest:
    config = read_adapter_config(folder, adapter_id)  # refuses non-LoRA, DoRA, modules_to_save, patterns
    weights = weights_file(folder, adapter_id)  # refuses a pickled adapter by name, never opens it
    header = read_safetensors_header(weights)
    adapter_pairs(header, config, adapter_id)  # only LoRA pairs, float, [r, in] / [out, r]
    tensors = {
        name: TensorInfo(shape=list(info["shape"]), dtype=info["dtype"], shard=WEIGHTS_FILE)
        for name, info in header.items()
    }
    raw = json.loads((folder / CONFIG_FILE).read_text())
    structure = sorted((name, tuple(t.shape)) for name, t in tensors.items())
    fingerprint = hashlib.sha256(
        json.dumps([ADAPTER_MODEL_TYPE, config.r, structure], separators=(",", ":")).encode()
    ).hexdigest()[:32]
    return ModelManifest(
        architecture=None,
        model_type=ADAPTER_MODEL_TYPE,
        hidden_size=None,
        num_layers=None,
        dtypes=sorted({t.dtype for t in tensors.values()}),
        parameter_count=sum(t.numel for t in tensors.values()),
        size_bytes=sum(t.numel * DTYPE_BYTES.get(t.dtype, 4) for t in tensors.values()),
        shards=[WEIGHTS_FILE],
        tensors=tensors,
        config=raw,
        fingerprint=fingerprint,
    )


def _not_an_adapter(model_id: str, reference: str) -> AlloyError:
    return AlloyError(
        ErrorCode.VALIDATION_FAILED,
        f"{model_id!r} in {reference!r} is a model, not a LoRA adapter",
        {"field": "models", "model": reference},
    )


def _adapter_alone(model_id: str) -> AlloyError:
    return AlloyError(
        ErrorCode.VALIDATION_FAILED,
        f"{model_id!r} is a LoRA adapter: merge it as 'base-id+{model_id}'",
        {"field": "models", "model": model_id},
    )


def combined_manifest(reference: str, base: ModelManifest, adapter: ModelManifest) -> ModelManifest:
    """The manifest of the input ``base+adapter`` (the base's), once the adapter fits the base."""
    model_id, adapter_id = split_reference(reference)
    if is_adapter(base):
        raise _adapter_alone(str(model_id))
    if not is_adapter(adapter):
        raise _not_an_adapter(str(adapter_id), reference)
    config = AdapterConfig.model_validate(adapter.config)
    header: dict[str, Any] = {n: {"shape": t.shape, "dtype": t.dtype} for n, t in adapter.tensors.items()}
    pairs = adapter_pairs(header, config, reference)
    check_adapter_fits(pairs, header, config, {n: t.shape for n, t in base.tensors.items()}, reference)
    return base


def input_manifest(manifest_of: Callable[[str], ModelManifest], reference: str) -> ModelManifest:
    """The manifest of a merge input (``manifest_of``: a registered id's manifest): a model, or
    ``base-id+adapter-id`` (MODEL_NOT_FOUND names the unknown id; an adapter alone, or a model used as an
    adapter, is VALIDATION_FAILED; an adapter that does not fit its base INCOMPATIBLE_MODELS)."""
    model_id, adapter_id = split_reference(reference)
    if adapter_id is None:
        manifest = manifest_of(reference)
        if is_adapter(manifest):
            raise _adapter_alone(reference)
        return manifest
    return combined_manifest(reference, manifest_of(model_id), manifest_of(adapter_id))


def input_source(reference: str, folder_of: Callable[[str], Path]) -> Path | LoraSource:
    """Where a merge input's files are: ``folder_of(id)`` for a model, base and adapter folders for a LoRA input."""
    model_id, adapter_id = split_reference(reference)
    if adapter_id is None:
        return Path(folder_of(reference))
    return LoraSource(Path(folder_of(model_id)), Path(folder_of(adapter_id)))
