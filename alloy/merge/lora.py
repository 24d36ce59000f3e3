"""LoRA inputs: a recipe model written ``base+adapter`` is the base model with a PEFT LoRA adapter folded in,
``W' = W + s * B @ A`` (``s = lora_alpha / r``, rsLoRA ``lora_alpha / sqrt(r)``; ``fan_in_fan_out`` stores W
transposed, so the delta is too), as mergekit does before merging (mergekit 0.1.5 merges the adapter into a copy
of the whole model with peft; here it is applied one tensor at a time as the merge reads it, so no model is ever
held in memory and nothing is written besides the merge's output).

The adapter folder holds ``adapter_config.json`` and ``adapter_model.safetensors``; pickled adapters
(``adapter_model.bin``) are refused, never loaded. Adapter tensors are named ``base_model.model.<module>.lora_A.weight``
and ``....lora_B.weight``; ``<module>.weight`` is the base tensor they change. Anything the adapter holds besides
LoRA pairs of linear layers (DoRA magnitudes, embedding LoRAs, ``modules_to_save`` copies, per-module rank or alpha
patterns) is refused by name rather than half-applied (VALIDATION_FAILED); an adapter whose targets the base lacks or
whose ``B @ A`` is not shaped like its base tensor is INCOMPATIBLE_MODELS. Every check runs before the merge writes
anything; the same checks serve a registered adapter (:mod:`alloy.registry.adapters`) at submit time.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from alloy.errors import AlloyError, ErrorCode
from alloy.merge.tensor_io import TORCH_DTYPES, SafetensorsReader
from alloy.model_manifest import ModelManifest, read_safetensors_header

SEPARATOR = "+"  # mergekit's ``model+adapter`` spelling
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLED_WEIGHTS = ("adapter_model.bin", "adapter_model.pt", "adapter_model.pth")
NAME_PREFIX = "base_model.model."  # PEFT's wrapper prefix (PeftModel.base_model.model is the transformers model)
PAIR_SUFFIXES = (".lora_A.weight", ".lora_B.weight")
FLOAT_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


def split_reference(reference: str) -> tuple[str, str | None]:
    """``"base+adapter"`` -> ``("base", "adapter")``; a plain model name -> ``(name, None)``."""
    if SEPARATOR not in reference:
        return reference, None
    model, _, adapter = reference.partition(SEPARATOR)
    if not model or not adapter or SEPARATOR in adapter:
        raise AlloyError(
            ErrorCode.VALIDATION_FAILED,
            f"model reference {reference!r} must be 'model+adapter' (one '+', both parts named)",
            {"field": "model", "model": reference},
        )
    return model, adapter


@dataclass(frozen=True)
class LoraSource:
    """Where a ``base+adapter`` model lives: the base model folder and the adapter folder."""

    model: Path
    adapter: Path


def model_folder(source: Path | LoraSource) -> Path:
    """The folder whose config, tokenizer and manifest a source has (the base model's, for a LoRA source)."""
    return source.model if isinstance(source, LoraSource) else Path(source)


class AdapterConfig(BaseModel):
    """The ``adapter_config.json`` fields the maths reads; the fields that would change it are refused."""

    model_config = ConfigDict(extra="ignore")

    peft_type: str = "LORA"
    r: int = Field(gt=0)
    lora_alpha: float
    use_rslora: bool = False
    fan_in_fan_out: bool = False
    target_modules: list[str] | str | None = None
    use_dora: bool = False
    modules_to_save: list[str] | None = None
    rank_pattern: dict[str, Any] = Field(default_factory=dict)
    alpha_pattern: dict[str, Any] = Field(default_factory=dict)

    @field_validator("peft_type")
    @classmethod
    def _lora_only(cls, value: str) -> str:
        if value.upper() != "LORA":
            raise ValueError(f"only LoRA adapters are supported, got peft_type {value!r}")
        return value

    @property
    def scale(self) -> float:
        return self.lora_alpha / (math.sqrt(self.r) if self.use_rslora else self.r)

    def unsupported(self) -> str | None:
        """The first setting whose maths is not ``W + s * B @ A`` with one s, or None."""
        if self.use_dora:
            return "use_dora (DoRA adapters are not supported)"
        if self.modules_to_save:
            return "modules_to_save (adapters carrying whole modules are not supported)"
        if self.rank_pattern or self.alpha_pattern:
            return "rank_pattern/alpha_pattern (per-module ranks or alphas are not supported)"
        return None


def _refuse(reference: str, message: str, **details: Any) -> AlloyError:
    return AlloyError(
        ErrorCode.VALIDATION_FAILED,
        f"adapter of {reference!r}: {message}",
        {"field": "model", "model": reference, **details},
    )


def read_adapter_config(folder: Path, reference: str) -> AdapterConfig:
    path = folder / CONFIG_FILE
    if not path.is_file():
        raise _refuse(reference, f"{CONFIG_FILE} is missing", file=CONFIG_FILE)
    try:
        config = AdapterConfig.model_validate(json.loads(path.read_text()))
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise _refuse(reference, f"{CONFIG_FILE} is not valid JSON", file=CONFIG_FILE) from None
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(map(str, first["loc"])) or CONFIG_FILE
        raise _refuse(reference, f"{CONFIG_FILE}: {field}: {first['msg']}", file=CONFIG_FILE) from None
    problem = config.unsupported()
    if problem:
        raise _refuse(reference, f"{CONFIG_FILE}: {problem}", file=CONFIG_FILE)
    return config


def weights_file(folder: Path, reference: str) -> Path:
    """The adapter's safetensors file; a pickled one is refused by name, never opened."""
    path = folder / WEIGHTS_FILE
    if path.is_file():
        return path
    pickled = [name for name in PICKLED_WEIGHTS if (folder / name).exists()]
    if pickled:
        raise _refuse(
            reference,
            f"{pickled[0]} is a pickle: adapters are read from {WEIGHTS_FILE} only (pickles are never loaded)",
            file=pickled[0],
        )
    raise _refuse(reference, f"{WEIGHTS_FILE} is missing", file=WEIGHTS_FILE)


def _incompatible(reference: str, message: str, **details: Any) -> AlloyError:
    return AlloyError(
        ErrorCode.INCOMPATIBLE_MODELS,
        f"adapter of {reference!r}: {message}",
        {"field": "model", "model": reference, **details},
    )


def _pairs(header: Mapping[str, Any], reference: str) -> dict[str, tuple[str, str]]:
    """Base tensor name -> (lora_A name, lora_B name); refuses tensors that are not halves of a LoRA pair."""
    halves: dict[str, dict[str, str]] = {}
    for name in header:
        suffix = next((s for s in PAIR_SUFFIXES if name.endswith(s)), None)
        if suffix is None or not name.startswith(NAME_PREFIX):
            raise _refuse(
                reference,
                f"tensor {name!r} is not a LoRA A/B weight of a linear layer "
                f"(expected {NAME_PREFIX}<module>.lora_A.weight / .lora_B.weight)",
                tensor=name,
            )
        module = name[len(NAME_PREFIX) : -len(suffix)]
        halves.setdefault(f"{module}.weight", {})[suffix] = name
    out = {}
    for target, found in halves.items():
        missing = [s.strip(".") for s in PAIR_SUFFIXES if s not in found]
        if missing:
            raise _refuse(reference, f"{target}: {missing[0]} is missing", tensor=target)
        out[target] = (found[PAIR_SUFFIXES[0]], found[PAIR_SUFFIXES[1]])
    return out


def adapter_pairs(header: Mapping[str, Any], config: AdapterConfig, reference: str) -> dict[str, tuple[str, str]]:
    """The adapter's LoRA pairs (base tensor name -> (lora_A, lora_B) names) from its safetensors header
    (name -> ``{shape, dtype}``), checked on their own: float weights, ``[r, in]`` and ``[out, r]`` (VALIDATION_FAILED)."""
    pairs = _pairs(header, reference)
    if not pairs:
        raise _refuse(reference, f"{WEIGHTS_FILE} holds no LoRA weights", file=WEIGHTS_FILE)
    for target, (a, b) in pairs.items():
        for half in (header[a], header[b]):
            if TORCH_DTYPES.get(half["dtype"]) not in FLOAT_DTYPES:
                raise _refuse(
                    reference, f"{target}: LoRA weights must be floating point, got {half['dtype']}", tensor=target
                )
        a_shape, b_shape = list(header[a]["shape"]), list(header[b]["shape"])
        if len(a_shape) != 2 or len(b_shape) != 2 or a_shape[0] != config.r or b_shape[1] != config.r:
            raise _refuse(
                reference,
                f"{target}: lora_A {a_shape} and lora_B {b_shape} are not [r, in] and [out, r] with r = {config.r}",
                tensor=target,
            )
    return pairs


def check_adapter_fits(
    pairs: Mapping[str, tuple[str, str]],
    header: Mapping[str, Any],
    config: AdapterConfig,
    base_shapes: Mapping[str, list[int]],
    reference: str,
) -> None:
    """INCOMPATIBLE_MODELS unless every targeted base tensor exists and is shaped like ``B @ A``."""
    for target, (a, b) in pairs.items():
        shape = base_shapes.get(target)
        if shape is None:
            raise _incompatible(reference, f"targets {target!r}, which the base model does not have", tensor=target)
        delta = [header[b]["shape"][0], header[a]["shape"][1]]
        if config.fan_in_fan_out:
            delta = delta[::-1]
        if list(shape) != delta:
            raise _incompatible(
                reference,
                f"{target}: B @ A is {delta} but the base tensor is {list(shape)}",
                tensor=target,
                shapes=[list(shape), delta],
            )


class LoraReader:
    """The base model's tensors as the merge reads them, each targeted one with the adapter's delta added (in
    float32, then back to the stored dtype, as peft merges into the model's own dtype). Same interface as
    :class:`SafetensorsReader`: ``tensors`` (name -> stored layout) and ``read(name)``."""

    def __init__(self, base: SafetensorsReader, manifest: ModelManifest, adapter_dir: Path, reference: str):
        self.base = base
        self.tensors = base.tensors
        self.config = read_adapter_config(adapter_dir, reference)
        weights = weights_file(adapter_dir, reference)
        header = read_safetensors_header(weights)
        self.names = adapter_pairs(header, self.config, reference)
        check_adapter_fits(
            self.names, header, self.config, {n: t.shape for n, t in manifest.tensors.items()}, reference
        )
        self._adapter = SafetensorsReader.from_files([weights])

    def read(self, name: str) -> torch.Tensor:
        weight = self.base.read(name)
        pair = self.names.get(name)
        if pair is None:
            return weight
        a, b = (self._adapter.read(half).float() for half in pair)
        delta = b @ a
        if self.config.fan_in_fan_out:
            delta = delta.T
        return weight.float().add_(delta, alpha=self.config.scale).to(weight.dtype)

    def close(self) -> None:
        self._adapter.close()
        self.base.close()


TensorReader = SafetensorsReader | LoraReader


def open_reader(model_id: str, source: Path | LoraSource, manifest: ModelManifest) -> TensorReader:
    base = SafetensorsReader(model_folder(source), manifest)
    if not isinstance(source, LoraSource):
        return base
    try:
        return LoraReader(base, manifest, source.adapter, model_id)
    except BaseException:
        base.close()
        raise


def open_readers(
    model_ids: list[str], sources: Mapping[str, Path | LoraSource], manifests: Mapping[str, ModelManifest]
) -> dict[str, TensorReader]:
    """One reader per model; a ``base+adapter`` id must come with a :class:`LoraSource` (and only such an id)."""
    readers: dict[str, TensorReader] = {}
    try:
        for model_id in model_ids:
            source = sources[model_id]
            is_lora = split_reference(model_id)[1] is not None
            if is_lora != isinstance(source, LoraSource):
                raise AlloyError(
                    ErrorCode.VALIDATION_FAILED,
                    f"model {model_id!r}: a 'model+adapter' reference needs a base and an adapter "
                    "folder, a plain model one folder",
                    {"field": "model", "model": model_id},
                )
            readers[model_id] = open_reader(model_id, source, manifests[model_id])
    except BaseException:
        for reader in readers.values():
            reader.close()
        raise
    return readers
