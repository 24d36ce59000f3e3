"""What a Hugging Face-layout model folder holds, read from ``config.json`` and the safetensors headers only.

No weight is loaded and nothing is unpickled: a folder whose weights are only pickle checkpoints
(``.bin``, ``.pt``, ``.pth``) is refused. The manifest is what the registry stores and what the merge
engine checks compatibility against before it reads a single tensor.
"""

from __future__ import annotations

import hashlib
import json
import struct
from math import prod
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from alloy.errors import AlloyError, ErrorCode

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors format's own cap

DTYPE_BYTES = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "U16": 2,
    "U32": 4,
    "U64": 8,
}


class TensorInfo(BaseModel):
    shape: list[int]
    dtype: str  # safetensors spelling: F32, BF16, ...
    shard: str  # file name inside the model folder

    @property
    def numel(self) -> int:
        return prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_BYTES.get(self.dtype, 4)


class ModelManifest(BaseModel):
    architecture: str | None
    model_type: str | None
    hidden_size: int | None
    num_layers: int | None
    dtypes: list[str]
    parameter_count: int
    size_bytes: int
    shards: list[str]
    tensors: dict[str, TensorInfo]
    config: dict[str, Any]
    fingerprint: str

    def describe_mismatch(self, other: ModelManifest) -> dict[str, Any] | None:
        """The first tensor whose presence or shape differs between two manifests, or None."""
        for name in sorted(set(self.tensors) | set(other.tensors)):
            mine, theirs = self.tensors.get(name), other.tensors.get(name)
            if mine is None or theirs is None or mine.shape != theirs.shape:
                return {
                    "tensor": name,
                    "shapes": [mine.shape if mine else None, theirs.shape if theirs else None],
                }
        return None


def read_safetensors_header(path: Path) -> dict[str, Any]:
    """The JSON header of one safetensors file (``__metadata__`` removed)."""
    with path.open("rb") as handle:
        raw_len = handle.read(8)
        if len(raw_len) != 8:
            raise AlloyError(ErrorCode.VALIDATION_FAILED, f"{path.name}: not a safetensors file (too short)")
        (length,) = struct.unpack("<Q", raw_len)
        if length <= 0 or length > MAX_HEADER_BYTES:
            raise AlloyError(ErrorCode.VALIDATION_FAILED, f"{path.name}: not a safetensors file (bad header length)")
        try:
            header = json.loads(handle.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise AlloyError(ErrorCode.VALIDATION_FAILED, f"{path.name}: not a safetensors file (bad header)") from None
    if not isinstance(header, dict):
        raise AlloyError(ErrorCode.VALIDATION_FAILED, f"{path.name}: not a safetensors file (bad header)")
    header.pop("__metadata__", None)
    return header


def weight_files(model_dir: Path) -> list[str]:
    """The safetensors shard names of a model folder, in index order; refuses pickle-only folders."""
    index = model_dir / INDEX_FILE
    if index.exists():
        weight_map = json.loads(index.read_text()).get("weight_map") or {}
        shards = sorted(set(weight_map.values()))
        if not shards:
            raise AlloyError(ErrorCode.VALIDATION_FAILED, f"{INDEX_FILE} has an empty weight_map")
        for shard in shards:
            _confine(model_dir, shard)
        return shards
    if (model_dir / SINGLE_FILE).exists():
        return [SINGLE_FILE]
    singles = sorted(p.name for p in model_dir.glob("*.safetensors"))
    if singles:
        return singles
    if any(p.suffix in PICKLE_SUFFIXES for p in model_dir.iterdir()):
        raise AlloyError(
            ErrorCode.VALIDATION_FAILED,
            "safetensors only: pickle checkpoints (.bin, .pt, .pth) are never loaded",
            {"path": str(model_dir)},
        )
    raise AlloyError(ErrorCode.VALIDATION_FAILED, "no safetensors weights found", {"path": str(model_dir)})


def _confine(root: Path, name: str) -> Path:
    resolved = (root / name).resolve()
    if root.resolve() not in resolved.parents:
        raise AlloyError(ErrorCode.VALIDATION_FAILED, f"shard {name!r} escapes the model folder")
    return resolved


def _layer_count(config: dict[str, Any]) -> int | None:
    for key in ("num_hidden_layers", "n_layer", "num_layers"):
        if isinstance(config.get(key), int):
            return config[key]
    return None


def _hidden_size(config: dict[str, Any]) -> int | None:
    for key in ("hidden_size", "n_embd", "d_model"):
        if isinstance(config.get(key), int):
            return config[key]
    return None


def read_manifest(model_dir: str | Path) -> ModelManifest:
    """Inspect a Hugging Face-layout folder without loading any weight."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise AlloyError(ErrorCode.VALIDATION_FAILED, "model path is not a folder", {"path": str(model_dir)})
    config_file = model_dir / "config.json"
    if not config_file.exists():
        raise AlloyError(ErrorCode.VALIDATION_FAILED, "config.json is missing", {"path": str(model_dir)})
    try:
        config = json.loads(config_file.read_text())
    except json.JSONDecodeError as exc:
        raise AlloyError(ErrorCode.VALIDATION_FAILED, f"config.json is not valid JSON: {exc}") from None

    shards = weight_files(model_dir)
    return manifest_from_headers(
        config, {shard: read_safetensors_header(_confine(model_dir, shard)) for shard in shards}
    )


def manifest_from_headers(config: dict[str, Any], headers: dict[str, dict[str, Any]]) -> ModelManifest:
    """The manifest of a folder from its ``config.json`` and its shards' safetensors headers (shard name ->
    header, in index order): what :func:`read_manifest` reads, for a folder whose shards are elsewhere (the groups
    of a fanned-out merge wrote them straight to the artifact store)."""
    tensors: dict[str, TensorInfo] = {}
    for shard, header in headers.items():
        for name, info in header.items():
            if name != "__metadata__":
                tensors[name] = TensorInfo(shape=list(info["shape"]), dtype=info["dtype"], shard=shard)
    architectures = config.get("architectures") or [None]
    structure = sorted((name, tuple(t.shape)) for name, t in tensors.items())
    fingerprint = hashlib.sha256(
        json.dumps([config.get("model_type"), structure], separators=(",", ":")).encode()
    ).hexdigest()[:32]
    return ModelManifest(
        architecture=architectures[0],
        model_type=config.get("model_type"),
        hidden_size=_hidden_size(config),
        num_layers=_layer_count(config),
        dtypes=sorted({t.dtype for t in tensors.values()}),
        parameter_count=sum(t.numel for t in tensors.values()),
        size_bytes=sum(t.nbytes for t in tensors.values()),
        shards=list(headers),
        tensors=tensors,
        config=config,
        fingerprint=fingerprint,
    )
