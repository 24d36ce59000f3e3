"""Franken merge (mergekit's passthrough): stack layer slices of several models into a new, deeper or shallower
model. Pure name planning: which source tensor becomes which output tensor."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kernels.errors import InvalidParameterError
from kernels.params import layer_index

_EMBEDDING_MARKERS = ("embed", "wte", "wpe", "embeddings")


@dataclass(frozen=True)
class LayerSlice:
    model: str
    start: int  # inclusive
    end: int  # exclusive


@dataclass(frozen=True)
class TensorSource:
    output_name: str
    model: str
    source_name: str


def is_embedding(tensor_name: str) -> bool:
    return any(marker in tensor_name for marker in _EMBEDDING_MARKERS)


def renumber(tensor_name: str, new_index: int) -> str:
    """``model.layers.7.mlp.up_proj.weight`` -> ``model.layers.<new_index>.mlp.up_proj.weight``."""
    old = layer_index(tensor_name)
    pattern = re.compile(rf"(^|\.)(layers|layer|h|blocks|block)\.{old}\.")
    return pattern.sub(lambda m: f"{m.group(1)}{m.group(2)}.{new_index}.", tensor_name, count=1)


def output_layer_count(slices: Sequence[LayerSlice]) -> int:
    return sum(s.end - s.start for s in slices)


def plan_franken(slices: Sequence[LayerSlice], names_by_model: Mapping[str, Sequence[str]],
                 layers_by_model: Mapping[str, int]) -> list[TensorSource]:
    """Output tensors in order: embeddings of the first slice's model, the sliced layers renumbered
    consecutively (a repeated layer becomes separate tensors), then the remaining non-layer tensors (final norm,
    LM head) of the last slice's model."""
    if not slices:
        raise InvalidParameterError("slices", "franken_merge needs at least one slice")
    for position, piece in enumerate(slices):
        available = layers_by_model.get(piece.model)
        if available is None:
            raise InvalidParameterError("slices", f"slice {position} names unknown model {piece.model!r}")
        if not 0 <= piece.start < piece.end <= available:
            raise InvalidParameterError(
                "slices", f"slice {position}: layer_range [{piece.start}, {piece.end}) is outside "
                          f"{piece.model!r}'s {available} layers (end is exclusive)")
    first, last = slices[0].model, slices[-1].model
    plan = [TensorSource(name, first, name) for name in names_by_model[first]
            if layer_index(name) is None and is_embedding(name)]
    output_index = 0
    for piece in slices:
        by_layer: dict[int, list[str]] = {}
        for name in names_by_model[piece.model]:
            index = layer_index(name)
            if index is not None:
                by_layer.setdefault(index, []).append(name)
        for source_index in range(piece.start, piece.end):
            for name in by_layer.get(source_index, []):
                plan.append(TensorSource(renumber(name, output_index), piece.model, name))
            output_index += 1
    plan += [TensorSource(name, last, name) for name in names_by_model[last]
             if layer_index(name) is None and not is_embedding(name)]
    return plan
